//! KVM state: the VM, its vCPUs and guest memory.
