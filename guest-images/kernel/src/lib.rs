//! The microVM guest kernel: our config fragment applied to Debian's linux-source-6.1, built and cached. (work in progress).
