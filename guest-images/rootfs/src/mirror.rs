//! Which Debian mirror a build fetches from: `STRATA_DEBIAN_MIRROR`, else the first `deb` entry for the suite in
//! the host's apt sources, read the way apt reads them: `sources.list` (one-line format), then the files of
//! `sources.list.d/` in name order, `*.list` (one-line) and `*.sources` (deb822). Only the suite itself counts
//! (`bookworm`, not `bookworm-updates` or `bookworm-security`), and only URLs debootstrap can fetch from.

use std::fs;
use std::io;
use std::path::Path;

use crate::{RootfsError, io_err};

/// The environment variable that overrides the host's apt sources: a mirror URL such as the one in a
/// `deb URL bookworm main` line.
pub const MIRROR_ENV: &str = "STRATA_DEBIAN_MIRROR";

/// The mirror for `suite`: `STRATA_DEBIAN_MIRROR` if set, else the first fitting source under `apt_dir`.
pub(crate) fn resolve(suite: &str, apt_dir: &Path) -> Result<String, RootfsError> {
    if let Some(value) = std::env::var_os(MIRROR_ENV).filter(|v| !v.is_empty()) {
        let value = value.to_string_lossy().trim().to_owned();
        if !fetchable(&value) {
            return Err(RootfsError::BadMirror(value));
        }
        return Ok(value.trim_end_matches('/').to_owned());
    }
    from_apt_dir(apt_dir, suite)
}

/// The first `deb` source for `suite` in `apt_dir/sources.list` and `apt_dir/sources.list.d/*.{list,sources}`.
pub(crate) fn from_apt_dir(apt_dir: &Path, suite: &str) -> Result<String, RootfsError> {
    let main = apt_dir.join("sources.list");
    let parts = apt_dir.join("sources.list.d");
    let mut files = vec![main];
    match fs::read_dir(&parts) {
        Ok(entries) => {
            let mut names: Vec<_> = entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "list" || e == "sources"))
                .collect();
            names.sort();
            files.extend(names);
        }
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => return Err(io_err("cannot read", &parts)(err)),
    }
    for file in &files {
        let text = match fs::read_to_string(file) {
            Ok(text) => text,
            Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
            Err(err) => return Err(io_err("cannot read", file)(err)),
        };
        let found = if file.extension().is_some_and(|e| e == "sources") {
            first_in_deb822(&text, suite)
        } else {
            first_in_one_line(&text, suite)
        };
        if let Some(uri) = found {
            return Ok(uri);
        }
    }
    Err(RootfsError::NoMirror {
        suite: suite.to_owned(),
        searched: format!("{} and {}/*.list|*.sources", apt_dir.join("sources.list").display(), parts.display()),
    })
}

/// A URL scheme debootstrap fetches from (not `cdrom:`, `mirror+file:`, `tor+http:` ...).
fn fetchable(uri: &str) -> bool {
    ["http://", "https://", "file:/"].iter().any(|scheme| uri.starts_with(scheme)) && !uri.contains(char::is_whitespace)
}

/// The first `deb URI SUITE ...` line (one-line format) for `suite`, without a trailing slash.
pub(crate) fn first_in_one_line(text: &str, suite: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let line = line.split('#').next().unwrap_or_default();
        let mut rest = line.trim_start().strip_prefix("deb")?;
        if !rest.starts_with(char::is_whitespace) {
            return None; // `deb-src`
        }
        rest = rest.trim_start();
        if let Some(options) = rest.strip_prefix('[') {
            rest = &options[options.find(']')? + 1..];
        }
        let mut words = rest.split_whitespace();
        let uri = words.next()?;
        (words.next()? == suite && fetchable(uri)).then(|| uri.trim_end_matches('/').to_owned())
    })
}

/// The first enabled deb822 stanza with `Types: deb` and `suite` among its `Suites:`: its first fetchable URI.
pub(crate) fn first_in_deb822(text: &str, suite: &str) -> Option<String> {
    let mut stanzas: Vec<Vec<(String, String)>> = vec![Vec::new()];
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        if line.trim().is_empty() {
            if stanzas.last().is_some_and(|s| !s.is_empty()) {
                stanzas.push(Vec::new());
            }
            continue;
        }
        let Some(stanza) = stanzas.last_mut() else { continue };
        if line.starts_with([' ', '\t']) {
            // A continuation line belongs to the previous field.
            if let Some((_, value)) = stanza.last_mut() {
                value.push(' ');
                value.push_str(line.trim());
            }
        } else if let Some((key, value)) = line.split_once(':') {
            stanza.push((key.trim().to_ascii_lowercase(), value.trim().to_owned()));
        }
    }
    stanzas.iter().find_map(|stanza| {
        let field = |name: &str| stanza.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
        let enabled = field("enabled").is_none_or(|v| !v.eq_ignore_ascii_case("no"));
        let is_deb = field("types").is_some_and(|v| v.split_whitespace().any(|t| t == "deb"));
        let has_suite = field("suites").is_some_and(|v| v.split_whitespace().any(|s| s == suite));
        if !(enabled && is_deb && has_suite) {
            return None;
        }
        field("uris")?.split_whitespace().find(|u| fetchable(u)).map(|u| u.trim_end_matches('/').to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // Example hosts only: the build never names a mirror of its own.
    const ONE_LINE: &str = "\
# deb http://example.org/debian bookworm main
deb-src http://src.example.org/debian bookworm main
deb http://security.example.org/debian-security bookworm-security main
deb [arch=amd64 signed-by=/usr/share/keyrings/x.gpg] http://mirror.example.org/debian/ bookworm main contrib
deb http://later.example.org/debian bookworm main
";

    const DEB822: &str = "\
Types: deb
URIs: http://disabled.example.org/debian
Suites: bookworm
Components: main
Enabled: no

Types: deb-src
URIs: http://src.example.org/debian
Suites: bookworm

# a comment between stanzas
Types: deb deb-src
# http://snapshot.example.org/archive/debian/20250520T000000Z
URIs: cdrom:/x http://mirror.example.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://security.example.org/debian-security
Suites: bookworm-security
Components: main
";

    #[test]
    fn one_line_sources_give_the_first_deb_line_of_the_suite() {
        assert_eq!(first_in_one_line(ONE_LINE, "bookworm").as_deref(), Some("http://mirror.example.org/debian"));
        assert_eq!(
            first_in_one_line(ONE_LINE, "bookworm-security").as_deref(),
            Some("http://security.example.org/debian-security")
        );
        assert_eq!(first_in_one_line(ONE_LINE, "trixie"), None);
        assert_eq!(first_in_one_line("deb cdrom:[Debian]/ bookworm main\n", "bookworm"), None);
    }

    #[test]
    fn deb822_sources_skip_disabled_and_source_only_stanzas() {
        assert_eq!(first_in_deb822(DEB822, "bookworm").as_deref(), Some("http://mirror.example.org/debian"));
        assert_eq!(first_in_deb822(DEB822, "bookworm-updates").as_deref(), Some("http://mirror.example.org/debian"));
        assert_eq!(first_in_deb822(DEB822, "trixie"), None);
        let folded = "Types: deb\nURIs:\n http://folded.example.org/debian\nSuites: sid\n  bookworm\n";
        assert_eq!(first_in_deb822(folded, "bookworm").as_deref(), Some("http://folded.example.org/debian"));
    }

    #[test]
    fn the_apt_dir_is_read_in_apts_order_and_a_missing_suite_is_a_typed_error() {
        let apt = tempfile::tempdir().expect("tempdir");
        let parts = apt.path().join("sources.list.d");
        fs::create_dir(&parts).expect("mkdir");
        fs::write(parts.join("b.sources"), DEB822).expect("write");
        fs::write(parts.join("a.list"), "deb http://a.example.org/debian bookworm-updates main\n").expect("write");
        fs::write(parts.join("0.list.disabled"), "deb http://disabled.example.org/debian bookworm main\n")
            .expect("write");
        assert_eq!(from_apt_dir(apt.path(), "bookworm").expect("found"), "http://mirror.example.org/debian");
        fs::write(apt.path().join("sources.list"), ONE_LINE.replace("mirror.", "first.")).expect("write");
        assert_eq!(from_apt_dir(apt.path(), "bookworm").expect("found"), "http://first.example.org/debian");
        let err = from_apt_dir(apt.path(), "trixie").expect_err("absent");
        assert!(matches!(err, RootfsError::NoMirror { .. }), "{err}");
        assert!(err.to_string().contains(MIRROR_ENV), "{err}");
        let empty = tempfile::tempdir().expect("tempdir");
        assert!(matches!(from_apt_dir(empty.path(), "bookworm"), Err(RootfsError::NoMirror { .. })));
    }
}
