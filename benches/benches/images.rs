//! Custom images beside the Debian image, in the same run (as root; `benches/run.sh` runs it):
//!
//! | name            | Strata                                                            | peer, same run                 |
//! |-----------------|-------------------------------------------------------------------|--------------------------------|
//! | `image_true`    | `/bin/true` in a fresh jail on the offline image (6 layers + base) | the same on the Debian image   |
//! | `image_sandbox` | start + `/bin/true` + close of a sandbox on the image              | the same on the Debian image   |
//! | `build_cached`  | `Engine::build_image` of the offline Dockerfile, every step cached | a build with one changed line  |
//!
//! The offline image installs a local `.deb` and a local wheel (`strata_benches::images`); its layers are each one
//! more idmapped read-only mount in every jail, which is what the first two figures price. Nothing here asserts a
//! time. Iterations: `$STRATA_BENCH_ITERS`, else 200 (30 with `--quick`).

use anyhow::Context;
use strata_benches::images::{offline_context, offline_dockerfile};
use strata_benches::{latency, ratio};
use strata_core::{Capabilities, ExecOptions, ImageName, Job, Limits, Status, Tier};
use strata_engine::build::BuildRequest;
use strata_engine::{Engine, EngineConfig};

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let iters: usize = match std::env::var("STRATA_BENCH_ITERS") {
        Ok(n) => n.parse().context("STRATA_BENCH_ITERS")?,
        Err(_) if quick => 30,
        Err(_) => 200,
    };
    let home = strata_engine::strata_home().context("no STRATA_HOME nor HOME")?;
    let engine = Engine::new(EngineConfig { home: Some(home), ..EngineConfig::default() })?;
    println!("# Strata custom images ({} cores, {iters} runs per figure)", std::thread::available_parallelism()?);
    if !engine.images().debian()?.is_installed() {
        println!("images: skipped: no Debian image (`strata images build debian` builds it)");
        return Ok(());
    }
    let tier = match engine.process() {
        Ok(tier) => tier,
        Err(err) => {
            println!("images: skipped: {err}");
            return Ok(());
        }
    };
    let context = tempfile::tempdir()?;
    offline_context(context.path());
    let name = ImageName::new(format!("bench-offline-{}", std::process::id()))?;
    let request = |greeting: &str| BuildRequest::new(name.clone(), context.path(), offline_dockerfile(greeting));
    let built = engine.build_image(&request("bench"), &|_| {})?;
    println!("# image {name}: {} layers over the Debian image", built.image.layers.len());

    let job = Job::Command { argv: vec!["/bin/true".into()] };
    let on = |image: Option<ImageName>| Capabilities { image, ..Capabilities::default() };
    let run = |caps: &Capabilities| -> anyhow::Result<()> {
        let outcome = tier.run(&job, caps, &Limits::default(), ExecOptions::default())?;
        anyhow::ensure!(outcome.status == Status::Exited { code: 0 }, "{outcome:?}");
        Ok(())
    };
    let (layered, debian) = (on(Some(name.clone())), on(None));
    let image_true = latency("image_true", iters, || run(&layered))?;
    let debian_true = latency("debian_true", iters, || run(&debian))?;
    image_true.print("fresh jail on the image");
    debian_true.print("fresh jail on the Debian image");
    ratio("image_true", &image_true, &debian_true, "debian");

    let sandbox = |caps: &Capabilities| -> anyhow::Result<()> {
        let sandbox = tier.start(caps, &Limits::default())?;
        let outcome = sandbox.exec(&job, ExecOptions::default())?;
        sandbox.close()?;
        anyhow::ensure!(outcome.status == Status::Exited { code: 0 }, "{outcome:?}");
        Ok(())
    };
    let image_sandbox = latency("image_sandbox", iters, || sandbox(&layered))?;
    let debian_sandbox = latency("debian_sandbox", iters, || sandbox(&debian))?;
    image_sandbox.print("sandbox on the image");
    debian_sandbox.print("sandbox on the Debian image");
    ratio("image_sandbox", &image_sandbox, &debian_sandbox, "debian");

    let builds = (iters / 10).max(3);
    let cached = latency("build_cached", builds, || Ok(engine.build_image(&request("bench"), &|_| {}).map(drop)?))?;
    let mut n = 0;
    let one_line = latency("build_one_line", builds, || {
        n += 1;
        Ok(engine.build_image(&request(&format!("bench{n}")), &|_| {}).map(drop)?)
    })?;
    cached.print("rebuild, every step cached");
    one_line.print("rebuild, the last RUN changed");
    ratio("build", &one_line, &cached, "cached");
    let store = engine.image_store()?;
    store.remove(&name)?;
    let pruned = store.prune(&Default::default())?;
    println!("# removed the image; prune freed {} layers ({} bytes)", pruned.layers.len(), pruned.bytes);
    Ok(())
}
