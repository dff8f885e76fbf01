//! The code interpreter through the official `e2b-code-interpreter` SDKs (Python 2.11.5 and JS 2.8.0, pinned):
//! rich results, `display()`, magics, streamed output, `envs`, timeouts that keep the context, the contexts API,
//! bash cells, refused languages, and the `strata-wasm-python` template, all against a real `strata serve`.

use std::path::PathBuf;
use std::process::Command;

use crate::e2b::{run_python_sdk_script, run_sdk_script};
use crate::util::{TestServer, process_tier};

/// What the Python SDK gets from a Strata sandbox's code interpreter.
const PYTHON_SCRIPT: &str = r#"
import time
from e2b import TimeoutException, NotFoundException, SandboxException
from e2b_code_interpreter import Sandbox

sbx = Sandbox.create()
ex = sbx.run_code("x = 41\nprint('hello')\nx + 1")
assert ex.text == "42" and ex.logs.stdout == ["hello\n"], ex
assert ex.execution_count == 1, ex.execution_count
# One interpreter: a cell needing processes sees what a pure cell defined.
assert sbx.run_code("import subprocess\nsubprocess.run(['true']).returncode, x").text == "(0, 41)"
# numpy's integers are 64-bit: the classic wasm32 overflow gives the native answer.
assert sbx.run_code("import numpy as np\nint(np.arange(10**6).sum())").text == "499999500000"
# A DataFrame: text, html and data.
ex = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
r = ex.results[0]
assert r.is_main_result and "<table" in r.html and r.data["columns"] == ["a", "b"], r
# A chart: png.
ex = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
assert any(r.png and not r.is_main_result for r in ex.results), ex
# display(), markdown, magics.
ex = sbx.run_code("from IPython.display import display, Markdown\ndisplay(Markdown('**hi**'))\n!echo bang\n%pwd")
assert [r.markdown for r in ex.results if r.markdown] == ["**hi**"], ex.results
assert ex.logs.stdout == ["bang\n"], ex.logs
assert ex.text == "'/home/user'", ex.text
# envs: for that cell only.
assert sbx.run_code("import os; os.environ.get('MY_VAR')", envs={"MY_VAR": "v1"}).text == "'v1'"
assert sbx.run_code("os.environ.get('MY_VAR')").text is None
# Errors.
ex = sbx.run_code("1/0")
assert ex.error.name == "ZeroDivisionError" and "division by zero" in ex.error.value, ex.error
# Streaming: the first line arrives while the cell still runs.
seen = []
started = time.monotonic()
sbx.run_code("import time\nprint('a', flush=True)\ntime.sleep(2)\nprint('b')", on_stdout=lambda m: seen.append((m.line, time.monotonic())))
ended = time.monotonic()
assert [line for line, _ in seen] == ["a\n", "b\n"], seen
assert ended - seen[0][1] > 1.0, (seen, ended)
# A timeout interrupts the cell; the context lives on.
try:
    sbx.run_code("import time\ntime.sleep(30)", timeout=2)
    raise SystemExit("no TimeoutException")
except TimeoutException:
    pass
after = sbx.run_code("x")
assert after.text == "41", ("the context lost its state after a timeout", after.text, after.error, after.logs)
# Contexts.
ctx = sbx.create_code_context(cwd="/tmp")
assert ctx.cwd == "/tmp" and ctx.language == "python"
assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "'/tmp'"
assert sbx.run_code("y = 5", context=ctx).error is None
assert sbx.run_code("'y' in globals()").text == "False"
assert ctx.id in [c.id for c in sbx.list_code_contexts()]
sbx.restart_code_context(ctx)
assert sbx.run_code("'y' in globals()", context=ctx).text == "False"
sbx.remove_code_context(ctx)
assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
# bash cells, and languages the sandbox cannot run.
bash = sbx.create_code_context(language="bash")
assert sbx.run_code("V=7; echo hi", context=bash).logs.stdout == ["hi\n"]
assert sbx.run_code("echo $V", context=bash).logs.stdout == ["7\n"]
try:
    sbx.run_code("console.log(1)", language="javascript")
    raise SystemExit("javascript ran")
except SandboxException as e:
    assert "not available" in str(e), e
sbx.kill()

# The wasm Python template: one wasm32 session, its semantics stated; a cell it cannot run is refused.
w = Sandbox.create(template="strata-wasm-python")
assert w.run_code("z = 2\nz * 21").text == "42"
ex = w.run_code("import subprocess\nsubprocess.run(['true'])")
assert ex.error.name == "SessionTierError" and "process" in ex.error.value, ex.error
assert w.run_code("z").text == "2"
w.kill()
print("CI OK")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn code_interpreter_sdk_gets_rich_results_contexts_and_streams() {
    if !process_tier("code_interpreter_sdk_gets_rich_results_contexts_and_streams") {
        return;
    }
    run_python_sdk_script(PYTHON_SCRIPT, "CI OK").await;
}

/// The pinned code-interpreter JS SDK (and the E2B SDK it runs on) under `$STRATA_HOME`, installed once with npm;
/// `None` (with a line saying why) when it cannot be installed here.
fn sdk_js_interpreter() -> Option<PathBuf> {
    let test = "code_interpreter_js_sdk_gets_rich_results_and_contexts";
    let dir = strata_engine::strata_home()?.join("e2b-code-interpreter-js-2.8.0");
    if !Command::new("node").arg("--version").output().is_ok_and(|o| o.status.success()) {
        eprintln!("skipping {test}: no node here");
        return None;
    }
    let ready = dir.join(".installed");
    if ready.exists() {
        return Some(dir);
    }
    let packages = ["@e2b/code-interpreter@2.8.0", "e2b@2.51.0"];
    let installed = std::fs::create_dir_all(&dir).is_ok()
        && Command::new("npm")
            .args(["install", "--no-audit", "--no-fund", "--silent", "--save-exact"])
            .args(packages)
            .current_dir(&dir)
            .status()
            .is_ok_and(|s| s.success());
    if !installed {
        eprintln!("skipping {test}: cannot install {} with npm into {}", packages.join(" "), dir.display());
        return None;
    }
    let _ = std::fs::write(&ready, b"");
    Some(dir)
}

/// What the JS SDK gets.
const JS_SCRIPT: &str = r#"
import { Sandbox } from '@e2b/code-interpreter'

function check(ok, what, value) {
  if (!ok) { console.error(`${what}: ${JSON.stringify(value)}`); process.exit(1) }
}
const sbx = await Sandbox.create()
let ex = await sbx.runCode("x = 41\nprint('hello')\nx + 1")
check(ex.text === '42' && ex.logs.stdout.join('') === 'hello\n', 'main result and stdout', ex)
ex = await sbx.runCode("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
check(ex.results.some(r => r.png && !r.isMainResult), 'png', ex.results.map(r => r.formats()))
ex = await sbx.runCode("import pandas as pd\npd.DataFrame({'a': [1]})")
check(ex.results[0].html.includes('<table'), 'html', ex.results)
ex = await sbx.runCode("from IPython.display import display, HTML\ndisplay(HTML('<b>x</b>'))\n!echo bang")
check(ex.results[0].html === '<b>x</b>' && ex.logs.stdout.join('') === 'bang\n', 'display and a magic', ex)
ex = await sbx.runCode("import os; os.environ['K']", { envs: { K: 'v' } })
check(ex.text === "'v'", 'envs', ex)
const seen = []
await sbx.runCode("import time\nprint('a', flush=True)\ntime.sleep(1.5)\nprint('b')", {
  onStdout: (m) => seen.push([m.line, Date.now()]),
})
check(seen.length === 2 && Date.now() - seen[0][1] > 1000, 'streamed stdout', seen)
const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
ex = await sbx.runCode('import os; os.getcwd()', { context: ctx })
check(ex.text === "'/tmp'", 'context cwd', ex)
check((await sbx.listCodeContexts()).some(c => c.id === ctx.id), 'list contexts', ctx)
await sbx.removeCodeContext(ctx.id)
let refused = false
try { await sbx.runCode('1', { language: 'r' }) } catch (e) { refused = e.constructor.name === 'SandboxError' && e.message.includes('400') }
check(refused, 'language r refused', null)
await sbx.kill()
console.log('JS CI OK')
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn code_interpreter_js_sdk_gets_rich_results_and_contexts() {
    if !process_tier("code_interpreter_js_sdk_gets_rich_results_and_contexts") {
        return;
    }
    let Some(dir) = tokio::task::spawn_blocking(sdk_js_interpreter).await.expect("setup") else { return };
    let script = dir.join(format!("interpreter-{}.mjs", std::process::id()));
    std::fs::write(&script, JS_SCRIPT).expect("script");
    let server = TestServer::start().await;
    run_sdk_script(&server, "node".as_ref(), &[script.as_os_str()], &dir, "JS CI OK").await;
    let _ = std::fs::remove_file(&script);
    server.stop().await;
}
