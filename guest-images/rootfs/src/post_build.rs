//! What is done to the tree after debootstrap, before it is hashed: make it a neutral, identity-free lower
//! layer. debootstrap copies the build host's `/etc/resolv.conf` and `/etc/hostname` into the tree, and the
//! package caches and logs say when and from where it was built; none of that belongs in a guest.
//!
//! Every write replaces what is there without following symlinks, so a link in the tree can never make a step
//! write outside it; files and directories written are owned by root (the build runs as root).

use std::fs;
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use crate::{RootfsError, io_err, mounts};

/// The version of the steps below: part of the recipe hash. Bump it whenever a step changes.
pub const POST_BUILD_VERSION: u32 = 3;

/// One post-build step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostBuildStep {
    /// Remove downloaded packages (`/var/cache/apt/archives/*.deb`), apt's binary caches
    /// (`/var/cache/apt/*.bin`) and package lists (`/var/lib/apt/lists/*`): `apt-get update` brings them back.
    /// Also ldconfig's auxiliary cache (`/var/cache/ldconfig/aux-cache`), which records inode numbers and
    /// times of the build: without it two builds from the same mirror state give the same tree hash.
    EmptyCaches,
    /// Empty the build logs under `/var/log` (dpkg, apt, alternatives): they record the build, not the image.
    EmptyLogs,
    /// `/etc/hostname` is `strata`.
    Hostname,
    /// `/etc/hosts` maps `localhost` and `strata` to the loopback addresses.
    Hosts,
    /// `/etc/resolv.conf` is empty (the host's was copied in); a job allowed on the network gets one.
    EmptyResolvConf,
    /// `/etc/machine-id` is empty: each guest gets its own identity, none is baked in.
    EmptyMachineId,
    /// `/etc/ssh/ssh_host_*` keys, if a package generated any, are removed: no two guests share a key.
    RemoveSshHostKeys,
    /// `/run/strata` exists (mode 0755): where the jail and the agent put their sockets.
    RunStrata,
    /// `/tmp` and `/var/tmp` are world-writable and sticky (mode 1777).
    StickyTmp,
    /// The account `user` (uid and gid `USER_ID`, home `/home/user` from `/etc/skel`, shell bash, no password),
    /// a member of the `sudo` group: what E2B's commands run as.
    UserAccount,
    /// `/usr/bin/sudo` is Strata's client (`SUDO`, `sudo.py`): it asks the jail's PID 1 to run the command as the jail's
    /// root (a set-user-ID `sudo` cannot work where every job runs with `no_new_privs`).
    Sudo,
    /// apt does not drop to its `_apt` account to download (`APT::Sandbox::User "root"` in
    /// `/etc/apt/apt.conf.d/00strata`): the jail's root has no capability to change its IDs, so apt's privilege drop
    /// fails (`setgroups 65534 failed`) and every `apt-get update` with it, in an image build's `RUN` as under `sudo`.
    /// The download runs as the jail's root instead, which is what the sandbox confines.
    AptAsRoot,
}

/// The ID of the image's unprivileged account `user`.
pub const USER_ID: u32 = 1000;

/// The image's `sudo` (a Python script: the image has `python3`).
pub const SUDO: &str = include_str!("sudo.py");

/// The steps, in the order they run.
pub const POST_BUILD_STEPS: &[PostBuildStep] = &[
    PostBuildStep::EmptyCaches,
    PostBuildStep::EmptyLogs,
    PostBuildStep::Hostname,
    PostBuildStep::Hosts,
    PostBuildStep::EmptyResolvConf,
    PostBuildStep::EmptyMachineId,
    PostBuildStep::RemoveSshHostKeys,
    PostBuildStep::RunStrata,
    PostBuildStep::StickyTmp,
    PostBuildStep::UserAccount,
    PostBuildStep::Sudo,
    PostBuildStep::AptAsRoot,
];

const APT_AS_ROOT: &str = "// Strata: the jail's root cannot change its IDs, so apt downloads as root (the sandbox confines it).\n\
                           APT::Sandbox::User \"root\";\n";

const HOSTS: &str = "127.0.0.1\tlocalhost strata\n::1\tlocalhost ip6-localhost ip6-loopback\n";

impl PostBuildStep {
    /// A few words for progress lines.
    pub fn describe(self) -> &'static str {
        match self {
            PostBuildStep::EmptyCaches => "removing apt's downloaded packages and lists, and ldconfig's aux-cache",
            PostBuildStep::EmptyLogs => "emptying the build logs",
            PostBuildStep::Hostname => "writing /etc/hostname",
            PostBuildStep::Hosts => "writing /etc/hosts",
            PostBuildStep::EmptyResolvConf => "emptying /etc/resolv.conf",
            PostBuildStep::EmptyMachineId => "emptying /etc/machine-id",
            PostBuildStep::RemoveSshHostKeys => "removing ssh host keys",
            PostBuildStep::RunStrata => "creating /run/strata",
            PostBuildStep::StickyTmp => "making /tmp and /var/tmp 1777",
            PostBuildStep::UserAccount => "adding the account user (uid 1000, /home/user, group sudo)",
            PostBuildStep::Sudo => "installing Strata's sudo client as /usr/bin/sudo",
            PostBuildStep::AptAsRoot => "letting apt download as root (/etc/apt/apt.conf.d/00strata)",
        }
    }

    /// Applies the step to the tree at `rootfs`.
    pub(crate) fn apply(self, rootfs: &Path) -> Result<(), RootfsError> {
        match self {
            PostBuildStep::EmptyCaches => {
                remove_matching(rootfs, "var/cache/apt/archives", |n| n.ends_with(".deb"))?;
                remove_matching(rootfs, "var/cache/apt", |n| n.ends_with(".bin"))?;
                remove_matching(rootfs, "var/lib/apt/lists", |_| true)?;
                remove_matching(rootfs, "var/cache/ldconfig", |n| n == "aux-cache")
            }
            PostBuildStep::EmptyLogs => empty_files_under(&inside(rootfs, "var/log")?),
            PostBuildStep::Hostname => replace_file(rootfs, "etc/hostname", b"strata\n", 0o644),
            PostBuildStep::Hosts => replace_file(rootfs, "etc/hosts", HOSTS.as_bytes(), 0o644),
            PostBuildStep::EmptyResolvConf => replace_file(rootfs, "etc/resolv.conf", b"", 0o644),
            PostBuildStep::EmptyMachineId => replace_file(rootfs, "etc/machine-id", b"", 0o444),
            PostBuildStep::RemoveSshHostKeys => remove_matching(rootfs, "etc/ssh", |n| n.starts_with("ssh_host_")),
            PostBuildStep::RunStrata => ensure_dir(rootfs, "run/strata", 0o755),
            PostBuildStep::StickyTmp => {
                ensure_dir(rootfs, "tmp", 0o1777)?;
                ensure_dir(rootfs, "var/tmp", 0o1777)
            }
            PostBuildStep::UserAccount => add_user(rootfs),
            PostBuildStep::Sudo => replace_file(rootfs, "usr/bin/sudo", SUDO.as_bytes(), 0o755),
            PostBuildStep::AptAsRoot => {
                ensure_dir(rootfs, "etc/apt", 0o755)?;
                ensure_dir(rootfs, "etc/apt/apt.conf.d", 0o755)?;
                replace_file(rootfs, "etc/apt/apt.conf.d/00strata", APT_AS_ROOT.as_bytes(), 0o644)
            }
        }
    }
}

/// Runs every step, reporting each.
pub(crate) fn apply_all(rootfs: &Path, progress: &dyn Fn(&str)) -> Result<(), RootfsError> {
    for step in POST_BUILD_STEPS {
        progress(&format!("debian image: {}", step.describe()));
        step.apply(rootfs)?;
    }
    Ok(())
}

/// `rootfs/relative`, after checking that every directory on the way is a real directory (not a symlink that
/// could lead out of the tree). The last component itself is not checked.
fn inside(rootfs: &Path, relative: &str) -> Result<PathBuf, RootfsError> {
    let mut path = rootfs.to_owned();
    let components: Vec<Component<'_>> = Path::new(relative).components().collect();
    for (i, component) in components.iter().enumerate() {
        let Component::Normal(name) = component else {
            return Err(RootfsError::Recipe(format!("post-build path {relative:?} is not plain")));
        };
        path.push(name);
        if i + 1 < components.len() {
            let meta = fs::symlink_metadata(&path).map_err(io_err("cannot stat", &path))?;
            if !meta.is_dir() {
                return Err(RootfsError::Io {
                    what: "cannot use",
                    path,
                    source: io::Error::other("not a directory (a symlink is not followed)"),
                });
            }
        }
    }
    Ok(path)
}

/// Removes the file, symlink or other non-directory at `path`, if any; a directory is an error.
fn remove_non_dir(path: &Path) -> Result<(), RootfsError> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => Err(RootfsError::Io {
            what: "cannot replace",
            path: path.to_owned(),
            source: io::Error::other("it is a directory"),
        }),
        Ok(_) => fs::remove_file(path).map_err(io_err("cannot remove", path)),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(err) => Err(io_err("cannot stat", path)(err)),
    }
}

/// Replaces `rootfs/relative` with a new root-owned file holding `contents`, mode `mode`.
fn replace_file(rootfs: &Path, relative: &str, contents: &[u8], mode: u32) -> Result<(), RootfsError> {
    use std::io::Write;
    let path = inside(rootfs, relative)?;
    remove_non_dir(&path)?;
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(&path)
        .map_err(io_err("cannot create", &path))?;
    file.write_all(contents).map_err(io_err("cannot write", &path))?;
    // The mode given to open is filtered by the umask.
    file.set_permissions(fs::Permissions::from_mode(mode)).map_err(io_err("cannot chmod", &path))?;
    if nix::unistd::geteuid().is_root() {
        std::os::unix::fs::fchown(&file, Some(0), Some(0)).map_err(io_err("cannot chown", &path))?;
    }
    Ok(())
}

/// Makes `rootfs/relative` a root-owned directory with mode `mode`, creating it (or replacing a non-directory).
fn ensure_dir(rootfs: &Path, relative: &str, mode: u32) -> Result<(), RootfsError> {
    let path = inside(rootfs, relative)?;
    if !fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
        remove_non_dir(&path)?;
        fs::create_dir(&path).map_err(io_err("cannot create", &path))?;
    }
    fs::set_permissions(&path, fs::Permissions::from_mode(mode)).map_err(io_err("cannot chmod", &path))?;
    if nix::unistd::geteuid().is_root() {
        std::os::unix::fs::lchown(&path, Some(0), Some(0)).map_err(io_err("cannot chown", &path))?;
    }
    Ok(())
}

/// Adds the account `user` ([`PostBuildStep::UserAccount`]); a tree that has it already is left as it is.
fn add_user(rootfs: &Path) -> Result<(), RootfsError> {
    let id = USER_ID;
    let passwd_path = inside(rootfs, "etc/passwd")?;
    let passwd = fs::read_to_string(&passwd_path).map_err(io_err("cannot read", &passwd_path))?;
    if passwd.lines().any(|line| line.starts_with("user:")) {
        return Ok(());
    }
    append_line(rootfs, "etc/passwd", &format!("user:x:{id}:{id}::/home/user:/bin/bash"))?;
    append_line(rootfs, "etc/shadow", "user:*:20000:0:99999:7:::")?;
    append_line(rootfs, "etc/gshadow", "user:!::")?;
    // The group file: `user`'s own group, and `user` among the `sudo` group's members.
    let group_path = inside(rootfs, "etc/group")?;
    let group = fs::read_to_string(&group_path).map_err(io_err("cannot read", &group_path))?;
    let mut lines: Vec<String> = Vec::new();
    let mut in_sudo = false;
    for line in group.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() == 4 && fields[0] == "sudo" {
            in_sudo = true;
            let members: Vec<&str> = fields[3].split(',').filter(|m| !m.is_empty()).chain(["user"]).collect();
            lines.push(format!("sudo:{}:{}:{}", fields[1], fields[2], members.join(",")));
        } else {
            lines.push(line.to_owned());
        }
    }
    if !in_sudo {
        lines.push("sudo:x:27:user".to_owned());
    }
    lines.push(format!("user:x:{id}:"));
    replace_file(rootfs, "etc/group", (lines.join("\n") + "\n").as_bytes(), 0o644)?;
    // The home, from /etc/skel (its plain files), all the user's.
    ensure_dir(rootfs, "home", 0o755)?;
    ensure_dir(rootfs, "home/user", 0o755)?;
    let home = inside(rootfs, "home/user")?;
    let skel = inside(rootfs, "etc/skel")?;
    if let Ok(entries) = fs::read_dir(&skel) {
        for entry in entries {
            let entry = entry.map_err(io_err("cannot read", &skel))?;
            if !entry.file_type().map_err(io_err("cannot stat", &entry.path()))?.is_file() {
                continue;
            }
            let contents = fs::read(entry.path()).map_err(io_err("cannot read", &entry.path()))?;
            let relative = format!("home/user/{}", entry.file_name().to_string_lossy());
            replace_file(rootfs, &relative, &contents, 0o644)?;
            give_to_user(&inside(rootfs, &relative)?)?;
        }
    }
    give_to_user(&home)
}

/// Makes `path` (not following a link) belong to `user`, when the build runs as root.
fn give_to_user(path: &Path) -> Result<(), RootfsError> {
    if nix::unistd::geteuid().is_root() {
        std::os::unix::fs::lchown(path, Some(USER_ID), Some(USER_ID)).map_err(io_err("cannot chown", path))?;
    }
    Ok(())
}

/// Appends `line` to the regular file `rootfs/relative`, keeping its owner and mode (a link is not followed).
fn append_line(rootfs: &Path, relative: &str, line: &str) -> Result<(), RootfsError> {
    use std::io::Write;
    let path = inside(rootfs, relative)?;
    let mut file = fs::OpenOptions::new()
        .append(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(&path)
        .map_err(io_err("cannot open", &path))?;
    if !file.metadata().map_err(io_err("cannot stat", &path))?.is_file() {
        return Err(RootfsError::Io { what: "cannot append to", path, source: io::Error::other("not a regular file") });
    }
    writeln!(file, "{line}").map_err(io_err("cannot write", &path))
}

/// Removes the entries of `rootfs/relative` whose name matches (directories with their contents); nothing when
/// the directory does not exist.
fn remove_matching(rootfs: &Path, relative: &str, matches: impl Fn(&str) -> bool) -> Result<(), RootfsError> {
    let dir = inside(rootfs, relative)?;
    match fs::symlink_metadata(&dir) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => return Ok(()),
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(io_err("cannot stat", &dir)(err)),
    }
    for entry in fs::read_dir(&dir).map_err(io_err("cannot read", &dir))? {
        let entry = entry.map_err(io_err("cannot read", &dir))?;
        if !entry.file_name().to_str().is_some_and(&matches) {
            continue;
        }
        let path = entry.path();
        if entry.file_type().map_err(io_err("cannot stat", &path))?.is_dir() {
            mounts::remove_build_tree(&path)?;
        } else {
            fs::remove_file(&path).map_err(io_err("cannot remove", &path))?;
        }
    }
    Ok(())
}

/// Truncates every regular file under `dir` (recursively, not following symlinks).
fn empty_files_under(dir: &Path) -> Result<(), RootfsError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(io_err("cannot read", dir)(err)),
    };
    for entry in entries {
        let entry = entry.map_err(io_err("cannot read", dir))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(io_err("cannot stat", &path))?;
        if kind.is_dir() {
            empty_files_under(&path)?;
        } else if kind.is_file() {
            fs::OpenOptions::new()
                .write(true)
                .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
                .open(&path)
                .and_then(|f| f.set_len(0))
                .map_err(io_err("cannot truncate", &path))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    /// The parts of a debootstrap tree the steps touch, including a symlink pointing out of the tree.
    fn sample(root: &Path, outside: &Path) {
        for dir in [
            "etc/ssh",
            "var/cache/apt/archives/partial",
            "var/lib/apt/lists/partial",
            "var/log/apt",
            "var/cache/ldconfig",
            "tmp",
            "run",
            "etc/skel",
            "usr/bin",
        ] {
            fs::create_dir_all(root.join(dir)).expect("mkdir");
        }
        fs::write(root.join("var/cache/apt/archives/python3_3.11.2-1_amd64.deb"), "deb").expect("write");
        fs::write(root.join("var/cache/apt/pkgcache.bin"), "bin").expect("write");
        fs::write(root.join("var/cache/ldconfig/aux-cache"), "inodes").expect("write");
        fs::write(root.join("var/lib/apt/lists/x_InRelease"), "list").expect("write");
        fs::write(root.join("var/log/dpkg.log"), "2025-01-01 install").expect("write");
        fs::write(root.join("var/log/apt/history.log"), "Start-Date").expect("write");
        fs::write(root.join("etc/ssh/ssh_host_ed25519_key"), "key").expect("write");
        fs::write(root.join("etc/ssh/ssh_config"), "config").expect("write");
        fs::write(root.join("etc/hostname"), "buildhost\n").expect("write");
        fs::write(root.join("etc/machine-id"), "0123\n").expect("write");
        fs::write(outside, "host resolver\n").expect("write");
        std::os::unix::fs::symlink(outside, root.join("etc/resolv.conf")).expect("symlink");
        fs::set_permissions(root.join("tmp"), fs::Permissions::from_mode(0o755)).expect("chmod");
        fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/bash\n").expect("write");
        fs::write(root.join("etc/shadow"), "root:*:20000:0:99999:7:::\n").expect("write");
        fs::write(root.join("etc/gshadow"), "root:*::\n").expect("write");
        fs::write(root.join("etc/group"), "root:x:0:\nsudo:x:27:admin\n").expect("write");
        fs::write(root.join("etc/skel/.bashrc"), "# bashrc\n").expect("write");
    }

    #[test]
    fn the_steps_neutralise_the_tree_and_never_write_through_a_symlink() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("rootfs");
        let outside = dir.path().join("host-resolv.conf");
        sample(&root, &outside);
        apply_all(&root, &|_| {}).expect("post-build");
        assert_eq!(fs::read_to_string(&outside).expect("read"), "host resolver\n", "the link was not followed");
        let meta = fs::symlink_metadata(root.join("etc/resolv.conf")).expect("stat");
        assert!(meta.is_file() && meta.len() == 0);
        assert_eq!(fs::read_to_string(root.join("etc/hostname")).expect("read"), "strata\n");
        assert!(fs::read_to_string(root.join("etc/hosts")).expect("read").starts_with("127.0.0.1\tlocalhost strata\n"));
        let machine_id = fs::metadata(root.join("etc/machine-id")).expect("stat");
        assert_eq!((machine_id.len(), machine_id.mode() & 0o7777), (0, 0o444));
        assert!(!root.join("etc/ssh/ssh_host_ed25519_key").exists());
        assert!(root.join("etc/ssh/ssh_config").exists());
        assert!(!root.join("var/cache/apt/archives/python3_3.11.2-1_amd64.deb").exists());
        assert!(root.join("var/cache/apt/archives/partial").is_dir());
        assert!(!root.join("var/cache/apt/pkgcache.bin").exists());
        assert!(!root.join("var/cache/ldconfig/aux-cache").exists());
        assert_eq!(fs::read_dir(root.join("var/lib/apt/lists")).expect("read").count(), 0);
        assert_eq!(fs::metadata(root.join("var/log/dpkg.log")).expect("stat").len(), 0);
        assert_eq!(fs::metadata(root.join("var/log/apt/history.log")).expect("stat").len(), 0);
        assert_eq!(fs::metadata(root.join("tmp")).expect("stat").mode() & 0o7777, 0o1777);
        assert_eq!(fs::metadata(root.join("var/tmp")).expect("stat").mode() & 0o7777, 0o1777);
        assert_eq!(fs::metadata(root.join("run/strata")).expect("stat").mode() & 0o7777, 0o755);
        let passwd = fs::read_to_string(root.join("etc/passwd")).expect("read");
        assert!(passwd.ends_with("root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n"), "{passwd}");
        let group = fs::read_to_string(root.join("etc/group")).expect("read");
        assert_eq!(group, "root:x:0:\nsudo:x:27:admin,user\nuser:x:1000:\n");
        assert_eq!(fs::read_to_string(root.join("home/user/.bashrc")).expect("read"), "# bashrc\n");
        let sudo = fs::metadata(root.join("usr/bin/sudo")).expect("stat");
        assert_eq!(sudo.mode() & 0o7777, 0o755, "executable, never set-user-ID");
        if nix::unistd::geteuid().is_root() {
            let home = fs::metadata(root.join("home/user")).expect("stat");
            assert_eq!((home.uid(), home.gid(), home.mode() & 0o7777), (USER_ID, USER_ID, 0o755));
        }
        // Applied again (a rebuilt tree), nothing is added twice.
        apply_all(&root, &|_| {}).expect("post-build again");
        assert_eq!(fs::read_to_string(root.join("etc/passwd")).expect("read"), passwd);
    }

    #[test]
    fn a_symlinked_parent_directory_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("rootfs");
        let elsewhere = dir.path().join("elsewhere");
        fs::create_dir_all(&root).expect("mkdir");
        fs::create_dir_all(&elsewhere).expect("mkdir");
        std::os::unix::fs::symlink(&elsewhere, root.join("etc")).expect("symlink");
        let err = PostBuildStep::Hostname.apply(&root).expect_err("etc is a link");
        assert!(matches!(err, RootfsError::Io { .. }), "{err}");
        assert!(!elsewhere.join("hostname").exists());
    }
}
