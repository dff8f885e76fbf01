//! The jail's accounts: a user name looked up in the jail's own `/etc/passwd` and `/etc/group`, never the host's.
//!
//! PID 1 reads them through [`Files`] (every link resolved inside the jail's root, regular files only, so a job
//! that replaced them with a FIFO or a link to a device cannot block or steer it), at most [`MAX_DB`] bytes each.

use std::io::Read;

use nix::errno::Errno;

use crate::files::Files;

/// The most bytes read of `/etc/passwd` or `/etc/group`.
pub const MAX_DB: u64 = 1 << 20;

/// The most supplementary groups a job gets.
pub const MAX_GROUPS: usize = 64;

/// The group whose members may use `sudo` ([`crate::sudo`]), as Debian's sudoers has it.
pub const SUDO_GROUP: &str = "sudo";

/// An account of the jail, with IDs as the jail sees them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    /// Its name.
    pub name: String,
    /// Its user ID.
    pub uid: u32,
    /// Its primary group.
    pub gid: u32,
    /// Its supplementary groups (the primary one included), at most [`MAX_GROUPS`].
    pub groups: Vec<u32>,
    /// Its home directory.
    pub home: String,
}

/// Why an account could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccountError {
    /// No such account in the jail's `/etc/passwd`.
    #[error("no user {0:?} in the sandbox's /etc/passwd")]
    Unknown(String),
    /// The database could not be read.
    #[error("cannot read {path}: {message}")]
    Unreadable {
        /// Which file.
        path: &'static str,
        /// Why.
        message: String,
    },
}

impl AccountError {
    /// The OS error number a job's start reports it with.
    pub fn errno(&self) -> Errno {
        match self {
            AccountError::Unknown(_) => Errno::ENOENT,
            AccountError::Unreadable { .. } => Errno::EIO,
        }
    }
}

/// Reads one database of the jail, bounded.
fn read_db(files: &Files, path: &'static str) -> Result<String, AccountError> {
    let unreadable = |message: String| AccountError::Unreadable { path, message };
    let (file, _) = files.open_read(path).map_err(|failure| unreadable(failure.to_string()))?;
    let mut text = Vec::new();
    file.take(MAX_DB).read_to_end(&mut text).map_err(|e| unreadable(e.to_string()))?;
    Ok(String::from_utf8_lossy(&text).into_owned())
}

/// Looks `name` up in the jail.
pub fn lookup(files: &Files, name: &str) -> Result<Account, AccountError> {
    let passwd = read_db(files, "/etc/passwd")?;
    let (uid, gid, home) = parse_passwd(&passwd, name).ok_or_else(|| AccountError::Unknown(name.to_owned()))?;
    // A missing or unreadable group file leaves the primary group only.
    let group = read_db(files, "/etc/group").unwrap_or_default();
    let mut groups = vec![gid];
    groups.extend(member_of(&group, name).into_iter().filter(|g| *g != gid));
    groups.truncate(MAX_GROUPS);
    Ok(Account { name: name.to_owned(), uid, gid, groups, home })
}

/// Whether the jail's user `uid` may use `sudo`: root, or a member of [`SUDO_GROUP`] (by its name in
/// `/etc/passwd`, or with it as primary group).
pub fn may_sudo(files: &Files, uid: u32) -> bool {
    if uid == 0 {
        return true;
    }
    let (Ok(passwd), Ok(group)) = (read_db(files, "/etc/passwd"), read_db(files, "/etc/group")) else {
        return false;
    };
    let Some((name, gid)) = passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        (fields.len() >= 7 && fields[2].parse() == Ok(uid)).then(|| (fields[0], fields[3].parse::<u32>().ok()))
    }) else {
        return false;
    };
    group.lines().any(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        fields.len() >= 4
            && fields[0] == SUDO_GROUP
            && (fields[3].split(',').any(|member| member == name) || fields[2].parse().ok() == gid)
    })
}

/// `(uid, gid, home)` of `name` in a passwd file (the first line naming it; malformed lines are skipped).
fn parse_passwd(passwd: &str, name: &str) -> Option<(u32, u32, String)> {
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() < 7 || fields[0] != name {
            return None;
        }
        Some((fields[2].parse().ok()?, fields[3].parse().ok()?, fields[5].to_owned()))
    })
}

/// The groups whose member lists name `name`.
fn member_of(group: &str, name: &str) -> Vec<u32> {
    group
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            if fields.len() < 4 || !fields[3].split(',').any(|member| member == name) {
                return None;
            }
            fields[2].parse().ok()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwd_and_group_lines_are_read_as_getpwnam_reads_them() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\nbroken\nuser:x:1000:1000::/home/user:/bin/bash\n\
                      user:x:5:5::/elsewhere:/bin/sh\nbad:x:notanumber:1::/:/bin/sh\n";
        assert_eq!(parse_passwd(passwd, "user"), Some((1000, 1000, "/home/user".to_owned())));
        assert_eq!(parse_passwd(passwd, "root"), Some((0, 0, "/root".to_owned())));
        assert_eq!(parse_passwd(passwd, "bad"), None);
        assert_eq!(parse_passwd(passwd, "nobody"), None);
        let group = "root:x:0:\nsudo:x:27:user\nuser:x:1000:\nadm:x:4:syslog,user\nodd\n";
        assert_eq!(member_of(group, "user"), vec![27, 4]);
        assert_eq!(member_of(group, "syslog"), vec![4]);
    }
}
