//! The Kconfig fragment (`strata.config`): parsing it, and checking a finished `.config` against it.

use std::collections::HashMap;
use std::fmt;

use crate::KernelError;

/// What a fragment line asks of one option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OptionValue {
    /// `CONFIG_X=y`: built in.
    Yes,
    /// `# CONFIG_X is not set`: off.
    No,
    /// `CONFIG_X=value`: a string (with its quotes) or number.
    Value(String),
}

/// One option of the fragment, with the reason written above it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KconfigOption {
    /// The symbol with its prefix, e.g. `CONFIG_VIRTIO_MMIO`.
    pub name: String,
    /// What it is set to.
    pub value: OptionValue,
    /// The comment line right above it, without its `#`.
    pub reason: String,
}

impl fmt::Display for KconfigOption {
    /// The option as a `.config` line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.value {
            OptionValue::Yes => write!(f, "{}=y", self.name),
            OptionValue::No => write!(f, "# {} is not set", self.name),
            OptionValue::Value(value) => write!(f, "{}={value}", self.name),
        }
    }
}

/// A parsed fragment: its options in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fragment {
    /// The options.
    pub options: Vec<KconfigOption>,
}

/// A symbol name: `CONFIG_` then upper-case letters, digits and underscores.
fn symbol(text: &str) -> Option<&str> {
    let rest = text.strip_prefix("CONFIG_")?;
    let ok = !rest.is_empty() && rest.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
    ok.then_some(text)
}

/// `# CONFIG_X is not set` → `CONFIG_X`.
fn not_set(line: &str) -> Option<&str> {
    symbol(line.strip_prefix("# ")?.strip_suffix(" is not set")?)
}

/// `CONFIG_X=value` → (`CONFIG_X`, value).
fn assignment(line: &str) -> Option<(&str, &str)> {
    let (name, value) = line.split_once('=')?;
    Some((symbol(name)?, value))
}

impl Fragment {
    /// Parses a fragment: every line is blank, a comment, `CONFIG_X=y`, `CONFIG_X=value` or
    /// `# CONFIG_X is not set`; every option has a reason comment on the line above it, is named once, and is not
    /// `=m` (the kernel has no modules).
    pub fn parse(text: &str) -> Result<Fragment, KernelError> {
        let bad = |n: usize, what: String| KernelError::Fragment(format!("line {}: {what}", n + 1));
        let mut options: Vec<KconfigOption> = Vec::new();
        let mut reason: Option<&str> = None;
        for (n, raw) in text.lines().enumerate() {
            let line = raw.trim_end();
            let option = if let Some(name) = not_set(line) {
                Some((name, OptionValue::No))
            } else if let Some((name, value)) = assignment(line) {
                let value = match value {
                    "y" => OptionValue::Yes,
                    "m" => return Err(bad(n, format!("{name}=m: the kernel has no modules"))),
                    "n" | "" => return Err(bad(n, format!("write `# {name} is not set` to turn it off"))),
                    v if v.starts_with('"') => {
                        if v.len() < 2 || !v.ends_with('"') || v[1..v.len() - 1].contains('"') {
                            return Err(bad(n, format!("{name} has a malformed string value {v}")));
                        }
                        OptionValue::Value(v.to_owned())
                    }
                    v if v.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') => OptionValue::Value(v.to_owned()),
                    v => return Err(bad(n, format!("{name} has a malformed value {v}"))),
                };
                Some((name, value))
            } else {
                None
            };
            match option {
                Some((name, value)) => {
                    let Some(why) = reason.take() else {
                        return Err(bad(n, format!("{name} has no `# reason` comment on the line above it")));
                    };
                    if options.iter().any(|o| o.name == name) {
                        return Err(bad(n, format!("{name} is named twice")));
                    }
                    options.push(KconfigOption { name: name.to_owned(), value, reason: why.to_owned() });
                }
                None if line.is_empty() => reason = None,
                None => {
                    let Some(comment) = line.strip_prefix('#') else {
                        return Err(bad(n, format!("not a comment nor an option: {line:?}")));
                    };
                    let comment = comment.trim();
                    // A section heading (`## ...`) or an empty comment is no reason.
                    reason = (!comment.is_empty() && !comment.starts_with('#')).then_some(comment);
                }
            }
        }
        if options.is_empty() {
            return Err(KernelError::Fragment("it sets no options".into()));
        }
        Ok(Fragment { options })
    }

    /// The option named `name` (with its `CONFIG_` prefix).
    pub fn get(&self, name: &str) -> Option<&KconfigOption> {
        self.options.iter().find(|o| o.name == name)
    }

    /// The options the final `.config` does not have as asked, each as `CONFIG_X (wanted y, got not set)`.
    pub fn mismatches(&self, config: &DotConfig) -> Vec<String> {
        self.options
            .iter()
            .filter_map(|option| {
                let got = config.get(&option.name);
                let ok = match &option.value {
                    OptionValue::Yes => got == Some("y"),
                    OptionValue::No => got.is_none(),
                    OptionValue::Value(value) => got == Some(value.as_str()),
                };
                let wanted = match &option.value {
                    OptionValue::Yes => "y",
                    OptionValue::No => "not set",
                    OptionValue::Value(value) => value,
                };
                (!ok).then(|| format!("{} (wanted {wanted}, got {})", option.name, got.unwrap_or("not set")))
            })
            .collect()
    }
}

/// A finished `.config`: the value of every symbol that is set (a symbol that is absent or `is not set` is off).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DotConfig {
    values: HashMap<String, String>,
}

impl DotConfig {
    /// Reads the `CONFIG_X=value` lines of a `.config`; comments and `is not set` lines are skipped.
    pub fn parse(text: &str) -> DotConfig {
        let values = text
            .lines()
            .filter_map(|line| assignment(line.trim_end()))
            .filter(|(_, value)| *value != "n")
            .map(|(name, value)| (name.to_owned(), value.to_owned()))
            .collect();
        DotConfig { values }
    }

    /// The value of `name` (e.g. `y` or `"-strata"`), `None` when it is off.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    /// How many symbols are `y`.
    pub fn enabled_count(&self) -> usize {
        self.values.values().filter(|v| *v == "y").count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FRAGMENT;

    #[test]
    fn the_fragment_parses_and_every_option_has_a_reason() {
        let fragment = Fragment::parse(FRAGMENT).expect("valid");
        assert!(fragment.options.len() > 50, "{}", fragment.options.len());
        for option in &fragment.options {
            assert!(option.reason.len() > 10, "{} has a thin reason: {:?}", option.name, option.reason);
        }
    }

    #[test]
    fn every_line_of_the_fragment_is_a_comment_an_option_or_blank() {
        for (n, line) in FRAGMENT.lines().enumerate() {
            let ok = line.is_empty() || line.starts_with('#') || assignment(line).is_some();
            assert!(ok, "line {}: {line:?}", n + 1);
        }
    }

    #[test]
    fn the_options_the_issue_asks_for_are_all_there() {
        let fragment = Fragment::parse(FRAGMENT).expect("valid");
        let on = [
            "64BIT",
            "SMP",
            "PRINTK",
            "TTY",
            "SERIAL_8250",
            "SERIAL_8250_CONSOLE",
            "BINFMT_ELF",
            "BINFMT_SCRIPT",
            "BLK_DEV",
            "VIRTIO_BLK",
            "VIRTIO",
            "VIRTIO_MMIO",
            "VIRTIO_MMIO_CMDLINE_DEVICES",
            "VSOCKETS",
            "VIRTIO_VSOCKETS",
            "NET",
            "UNIX",
            "INET",
            "EXT4_FS",
            "SQUASHFS",
            "SQUASHFS_ZSTD",
            "SQUASHFS_XZ",
            "OVERLAY_FS",
            "TMPFS",
            "DEVTMPFS",
            "DEVTMPFS_MOUNT",
            "PROC_FS",
            "SYSFS",
            "CGROUPS",
            "MEMCG",
            "CGROUP_PIDS",
            "SECCOMP",
            "SECCOMP_FILTER",
            "BLK_DEV_INITRD",
            "RD_GZIP",
            "FUTEX",
            "EPOLL",
            "SIGNALFD",
            "TIMERFD",
            "EVENTFD",
            "SHMEM",
            "AIO",
            "FILE_LOCKING",
            "MULTIUSER",
            "POSIX_TIMERS",
            "KVM_GUEST",
            "PARAVIRT",
            "PVH",
            "UNWINDER_FRAME_POINTER",
        ];
        for name in on {
            let option = fragment.get(&format!("CONFIG_{name}")).unwrap_or_else(|| panic!("CONFIG_{name} missing"));
            assert_eq!(option.value, OptionValue::Yes, "CONFIG_{name}");
        }
        for name in ["MODULES", "ACPI", "PCI", "DEBUG_INFO"] {
            let option = fragment.get(&format!("CONFIG_{name}")).unwrap_or_else(|| panic!("CONFIG_{name} missing"));
            assert_eq!(option.value, OptionValue::No, "CONFIG_{name}");
        }
    }

    #[test]
    fn an_option_without_a_reason_is_refused() {
        let err = Fragment::parse("# reason\nCONFIG_A=y\nCONFIG_B=y\n").expect_err("no reason");
        assert!(err.to_string().contains("line 3: CONFIG_B has no `# reason`"), "{err}");
        let err = Fragment::parse("# reason\n\nCONFIG_A=y\n").expect_err("blank line between");
        assert!(err.to_string().contains("CONFIG_A has no"), "{err}");
        let err = Fragment::parse("## Heading\nCONFIG_A=y\n").expect_err("a heading is no reason");
        assert!(err.to_string().contains("CONFIG_A has no"), "{err}");
    }

    #[test]
    fn malformed_lines_modules_and_repeats_are_refused() {
        for (text, needle) in [
            ("# r\nCONFIG_A=m\n", "no modules"),
            ("# r\nCONFIG_A=n\n", "is not set"),
            ("# r\nCONFIG_a=y\n", "not a comment nor an option"),
            ("# r\nFOO=y\n", "not a comment nor an option"),
            ("# r\nCONFIG_A=\"x\n", "malformed string"),
            ("# r\nCONFIG_A=a b\n", "malformed value"),
            ("# r\nCONFIG_A=y\n# r\nCONFIG_A=y\n", "named twice"),
            ("# only a comment\n", "no options"),
        ] {
            let err = Fragment::parse(text).expect_err(text);
            assert!(err.to_string().contains(needle), "{text:?}: {err}");
        }
    }

    #[test]
    fn options_parse_to_their_values_and_print_back() {
        let text = "# a\nCONFIG_A=y\n# b\n# CONFIG_B is not set\n# c\nCONFIG_C=\"-x\"\n# d\nCONFIG_D=0x100\n";
        let fragment = Fragment::parse(text).expect("valid");
        let values: Vec<_> = fragment.options.iter().map(|o| (o.name.as_str(), o.value.clone())).collect();
        assert_eq!(
            values,
            [
                ("CONFIG_A", OptionValue::Yes),
                ("CONFIG_B", OptionValue::No),
                ("CONFIG_C", OptionValue::Value("\"-x\"".into())),
                ("CONFIG_D", OptionValue::Value("0x100".into())),
            ]
        );
        assert_eq!(fragment.options[1].reason, "b");
        let printed: Vec<String> = fragment.options.iter().map(ToString::to_string).collect();
        assert_eq!(printed, ["CONFIG_A=y", "# CONFIG_B is not set", "CONFIG_C=\"-x\"", "CONFIG_D=0x100"]);
    }

    #[test]
    fn options_kconfig_dropped_are_named() {
        let fragment =
            Fragment::parse("# a\nCONFIG_A=y\n# b\n# CONFIG_B is not set\n# c\nCONFIG_C=\"-x\"\n# d\nCONFIG_D=y\n")
                .expect("valid");
        let config = DotConfig::parse("CONFIG_A=y\n# CONFIG_B is not set\nCONFIG_C=\"-x\"\nCONFIG_D=y\nCONFIG_E=y\n");
        assert_eq!(fragment.mismatches(&config), Vec::<String>::new());
        let config = DotConfig::parse("# CONFIG_A is not set\nCONFIG_B=y\nCONFIG_C=\"\"\nCONFIG_D=y\n");
        assert_eq!(
            fragment.mismatches(&config),
            [
                "CONFIG_A (wanted y, got not set)",
                "CONFIG_B (wanted not set, got y)",
                "CONFIG_C (wanted \"-x\", got \"\")",
            ]
        );
        assert_eq!(config.enabled_count(), 2);
    }
}
