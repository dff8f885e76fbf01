//! What routing adds to a job: the import scan and the router's decision, per job, as HDR percentiles.
//!
//! | name                | what is timed                                                                       |
//! |---------------------|-------------------------------------------------------------------------------------|
//! | `scan_200_lines`    | `scan::scan_source` of a 200-line script and `scan::route_python` against the list  |
//! | `route_code_200`    | `Engine::route_with_limits` of that script as `-c` code (→ wasm)                    |
//! | `route_file_200`    | the same script as a file (read + scan + decision)                                 |
//! | `route_native_200`  | the script with `import subprocess` (→ the process tier, where it runs here)        |
//! | `route_wasm_module` | a WebAssembly job, for comparison (no scan)                                         |
//!
//! The policy accepts wasm32 numerics (`python_wasm_numpy = true`), so the script, which imports numpy, stays on
//! wasm. Target: routing and the scan add at most 1 ms to a job; the last line compares p99 with it. Uses the
//! Python runtime under `$STRATA_HOME` for the wasm build's module list (generated and cached on first use).
//! `ROUTE_ITERS` sets the number of timed runs per case.

use std::path::Path;
use std::time::Duration;

use strata_benches::{Figures, latency, strata_home};
use strata_core::{Capabilities, Job, Limits, PythonSource};
use strata_engine::{Engine, EngineConfig, Policy, TierChoice, scan};

/// A 200-line script in the shape of real jobs: imports at the top and in functions, an optional import, classes,
/// attribute chains and calls.
fn script(extra_import: &str) -> String {
    let mut text = String::from(
        "import json\nimport os, sys\nimport numpy as np\nimport pandas as pd\nfrom collections import Counter, \
         defaultdict\nfrom pathlib import Path\ntry:\n    import yaml\nexcept ImportError:\n    yaml = None\n",
    );
    text.push_str(extra_import);
    let mut n = 0;
    while text.lines().count() < 196 {
        n += 1;
        text.push_str(&format!(
            "\n\nclass Model{n}:\n    def __init__(self, data):\n        self.data = np.asarray(data)\n        \
             self.count = Counter(str(x) for x in self.data)\n\n    def summary(self):\n        import math\n        \
             frame = pd.DataFrame({{'v': self.data}})\n        return {{'mean': float(frame.v.mean()), 'log': \
             math.log1p(len(self.data)), 'path': os.path.join('out', f'{{self.count}}.json')}}\n"
        ));
    }
    text.push_str("\nif __name__ == '__main__':\n    print(json.dumps(Model1([1, 2, 3]).summary()))\n");
    text
}

fn main() -> anyhow::Result<()> {
    let iters: usize = std::env::var("ROUTE_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000);
    // The script computes with numpy: accepting wasm32 numerics keeps it on wasm, whose decision is timed.
    let policy =
        Policy::from_toml("[tiers]\nnative = \"process\"\npython_wasm_numpy = true\n", Path::new("bench-policy.toml"))?;
    let engine = Engine::new(EngineConfig { home: Some(strata_home()), policy, ..EngineConfig::default() })?;
    let modules = engine.wasm_modules()?.clone();
    let limits = Limits::default();
    let source = script("");
    anyhow::ensure!(source.lines().count() >= 200, "the script has {} lines", source.lines().count());

    let mut all: Vec<Figures> = Vec::new();
    all.push(latency("scan_200_lines", iters, || {
        let refs = scan::scan_source(&source).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        anyhow::ensure!(matches!(
            scan::route_python(&refs, Some(&modules), scan::Wasm32Numerics::Accepted),
            scan::PythonVerdict::Wasm(_)
        ));
        Ok(())
    })?);

    let code = Job::Python { source: PythonSource::Code(source.clone()), args: Vec::new() };
    let route = |job: &Job, expect: strata_core::TierKind| -> anyhow::Result<()> {
        let route = engine.route_with_limits(TierChoice::Auto, job, &Capabilities::default(), &limits)?;
        anyhow::ensure!(route.decision.tier == expect, "{:?}", route.decision);
        Ok(())
    };
    all.push(latency("route_code_200", iters, || route(&code, strata_core::TierKind::Wasm))?);

    let dir = tempfile::tempdir()?;
    let file = dir.path().join("job.py");
    std::fs::write(&file, &source)?;
    let file_job = Job::Python { source: PythonSource::File(file), args: Vec::new() };
    all.push(latency("route_file_200", iters, || route(&file_job, strata_core::TierKind::Wasm))?);

    if engine.process().is_ok() {
        let native = Job::Python { source: PythonSource::Code(script("import subprocess\n")), args: Vec::new() };
        all.push(latency("route_native_200", iters, || route(&native, strata_core::TierKind::Process))?);
    } else {
        println!("route_native_200: skipped, the process tier cannot run here");
    }

    let wasm = Job::wasm_file("module.wasm", Vec::new());
    all.push(latency("route_wasm_module", iters, || route(&wasm, strata_core::TierKind::Wasm))?);

    for figures in &all {
        figures.print("strata");
    }
    let worst = all.iter().map(|f| f.p_us(0.99)).fold(0.0, f64::max);
    let target = Duration::from_millis(1).as_secs_f64() * 1e6;
    println!(
        "{:<26} worst p99 {worst:.1}us against the 1 ms target: {}",
        "route_target",
        if worst <= target { "met" } else { "MISSED" }
    );
    Ok(())
}
