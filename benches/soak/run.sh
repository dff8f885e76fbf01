#!/usr/bin/env bash
# The soak and chaos harness of `strata serve` (benches/soak): builds the release `strata` and `strata-soak`,
# then drives a real server on a loopback port with a bounded mix of concurrent jobs.
#
#   benches/soak/run.sh                      # 10 minutes of load, resources sampled every 15 s
#   benches/soak/run.sh --duration 45s       # a short run, to check the harness itself
#   benches/soak/run.sh --mode chaos         # SIGKILL the server under load and restart it, 3 rounds
#   benches/soak/run.sh --help               # every option (--concurrency, --sample-every, --rounds, ...)
#
# The process-tier jobs need root and the Debian image (`strata images build debian`). Exit status 0 = PASS.
set -euo pipefail
cd "$(dirname "$0")/../.."

export STRATA_HOME="${STRATA_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/strata}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$STRATA_HOME/cargo-target}"
echo "==> building strata and strata-soak (release)"
cargo build --release --quiet -p strata-cli -p strata-soak
exec "$CARGO_TARGET_DIR/release/strata-soak" --strata "$CARGO_TARGET_DIR/release/strata" "$@"
