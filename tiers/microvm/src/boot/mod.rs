//! Loading and entering a Linux kernel.
