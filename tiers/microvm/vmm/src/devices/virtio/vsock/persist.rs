//! Snapshot state of the vsock device: its configuration (the guest CID) only. As in Firecracker, connections
//! are not saved: a restored device starts with none and, once active, sends the guest a transport-reset event
//! so that the guest drops its own side of them and re-reads its CID. The queues are the transport's
//! ([`crate::devices::virtio::persist`]). The host socket is a constructor argument, and so is, for a fork, a
//! new CID.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::device::{VsockConfig, VsockDevice, VsockError, check_cid};
use crate::devices::virtio::persist::Persist;

/// The vsock device's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockState {
    /// The guest's CID.
    pub guest_cid: u64,
}

/// The host resources a vsock device is rebuilt with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VsockConstructorArgs {
    /// The host-side socket to bind (must not exist).
    pub uds_path: PathBuf,
    /// A new CID (a fork's identity); `None` keeps the saved one.
    pub guest_cid: Option<u64>,
}

/// Why a vsock state was refused.
#[derive(Debug, thiserror::Error)]
pub enum VsockPersistError {
    /// The saved CID is reserved or out of range.
    #[error("snapshot guest CID is invalid")]
    SavedCid(#[source] VsockError),
    /// The device could not be rebuilt (new CID invalid, socket path in use).
    #[error("cannot rebuild the vsock device")]
    Device(#[source] VsockError),
}

impl Persist for VsockDevice {
    type State = VsockState;
    type ConstructorArgs = VsockConstructorArgs;
    type Error = VsockPersistError;

    fn save(&self) -> VsockState {
        VsockState { guest_cid: self.guest_cid }
    }

    fn restore(args: VsockConstructorArgs, state: &VsockState) -> Result<VsockDevice, VsockPersistError> {
        check_cid(state.guest_cid).map_err(VsockPersistError::SavedCid)?;
        let guest_cid = args.guest_cid.unwrap_or(state.guest_cid);
        let mut device =
            VsockDevice::new(VsockConfig { guest_cid, uds_path: args.uds_path }).map_err(VsockPersistError::Device)?;
        device.transport_reset_pending = true;
        Ok(device)
    }
}

impl VsockDevice {
    /// Changes the guest's CID (the transport should then call
    /// [`notify_config_change`](crate::devices::virtio::mmio::MmioTransport::notify_config_change)); pending
    /// connections keep working only if the guest never used the old CID, so this is for restores and forks.
    pub fn change_guest_cid(&mut self, guest_cid: u64) -> Result<(), VsockError> {
        self.set_guest_cid(check_cid(guest_cid)?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn save_restore_round_trip() {
        let dir = tempfile::tempdir().expect("tempdir");
        let device =
            VsockDevice::new(VsockConfig { guest_cid: 7, uds_path: dir.path().join("a.sock") }).expect("device");
        let state = device.save();
        assert_eq!(state, VsockState { guest_cid: 7 });
        let args = VsockConstructorArgs { uds_path: dir.path().join("b.sock"), guest_cid: None };
        let restored = VsockDevice::restore(args, &state).expect("restore");
        assert_eq!(restored.save(), state);
        assert!(restored.transport_reset_pending());
        assert!(dir.path().join("b.sock").exists());
        // A fork gets a new identity from its constructor arguments.
        let args = VsockConstructorArgs { uds_path: dir.path().join("c.sock"), guest_cid: Some(9) };
        assert_eq!(VsockDevice::restore(args, &state).expect("fork").guest_cid(), 9);
        let json = serde_json::to_string(&state).expect("serialize");
        assert_eq!(serde_json::from_str::<VsockState>(&json).expect("deserialize"), state);
    }

    #[test]
    fn restore_refuses_bad_cids_and_busy_sockets() {
        let dir = tempfile::tempdir().expect("tempdir");
        let args = VsockConstructorArgs { uds_path: dir.path().join("a.sock"), guest_cid: None };
        assert!(matches!(
            VsockDevice::restore(args.clone(), &VsockState { guest_cid: 2 }),
            Err(VsockPersistError::SavedCid(_))
        ));
        let fork = VsockConstructorArgs { guest_cid: Some(1), ..args.clone() };
        assert!(matches!(VsockDevice::restore(fork, &VsockState { guest_cid: 5 }), Err(VsockPersistError::Device(_))));
        let _first = VsockDevice::restore(args.clone(), &VsockState { guest_cid: 5 }).expect("first");
        assert!(matches!(VsockDevice::restore(args, &VsockState { guest_cid: 5 }), Err(VsockPersistError::Device(_))));
        assert!(serde_json::from_str::<VsockState>(r#"{"guest_cid":3,"x":1}"#).is_err());
    }
}
