//! Fixtures for image builds that tests and benchmarks share: a build context with a local Debian package and a
//! local Python wheel, both made on the spot (no network), and a Dockerfile that installs them.

use std::path::Path;
use std::process::Command;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A context with a local `.deb` (a package `strata-hello` installing `/usr/bin/strata-hello`) and a pure-Python
/// wheel (`stratawheel`, `answer() == 42`), both made here: no network.
pub fn offline_context(dir: &Path) {
    let pkg = dir.join("pkg");
    std::fs::create_dir_all(pkg.join("DEBIAN")).expect("mkdir");
    std::fs::create_dir_all(pkg.join("usr/bin")).expect("mkdir");
    std::fs::write(
        pkg.join("DEBIAN/control"),
        "Package: strata-hello\nVersion: 1.0\nArchitecture: all\nMaintainer: Strata Tests <tests@localhost>\n\
         Description: a test package\n",
    )
    .expect("control");
    let program = pkg.join("usr/bin/strata-hello");
    std::fs::write(&program, "#!/bin/sh\necho hello from a deb\n").expect("program");
    Command::new("chmod").args(["755"]).arg(&program).status().expect("chmod");
    let built = Command::new("dpkg-deb")
        .arg("--build")
        .arg(&pkg)
        .arg(dir.join("strata-hello_1.0_all.deb"))
        .output()
        .expect("dpkg-deb");
    assert!(built.status.success(), "{}", text(&built.stderr));
    std::fs::remove_dir_all(&pkg).expect("rm");
    let wheel = r#"
import base64, hashlib, sys, zipfile
name, ver = 'stratawheel', '1.0'
files = {f'{name}/__init__.py': 'def answer():\n    return 42\n',
         f'{name}-{ver}.dist-info/METADATA': f'Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n',
         f'{name}-{ver}.dist-info/WHEEL': 'Wheel-Version: 1.0\nGenerator: strata-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n'}
record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(c.encode()).digest()).rstrip(b'=').decode()},{len(c.encode())}" for p, c in files.items()]
record.append(f'{name}-{ver}.dist-info/RECORD,,')
with zipfile.ZipFile(f'{sys.argv[1]}/{name}-{ver}-py3-none-any.whl', 'w') as z:
    for p, c in files.items():
        z.writestr(p, c)
    z.writestr(f'{name}-{ver}.dist-info/RECORD', '\n'.join(record) + '\n')
"#;
    let made = Command::new("python3").args(["-c", wheel]).arg(dir).output().expect("python3");
    assert!(made.status.success(), "{}", text(&made.stderr));
}

/// The Dockerfile of the offline test, its last line carrying `greeting`.
pub fn offline_dockerfile(greeting: &str) -> String {
    format!(
        "FROM strata-debian\n\
         ARG WHEEL=stratawheel-1.0-py3-none-any.whl\n\
         ENV APP_HOME=/opt/app\n\
         COPY *.deb /tmp/\n\
         RUN dpkg -i /tmp/strata-hello_1.0_all.deb && rm /tmp/strata-hello_1.0_all.deb\n\
         COPY $WHEEL /tmp/\n\
         RUN pip install --no-index --break-system-packages /tmp/$WHEEL && rm /tmp/$WHEEL && rm /etc/issue\n\
         WORKDIR $APP_HOME\n\
         RUN echo {greeting} > greeting.txt\n\
         USER user\n\
         CMD [\"strata-hello\"]\n"
    )
}
