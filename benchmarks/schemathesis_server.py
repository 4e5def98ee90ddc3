"""Property-based run of schemathesis against the real server's /openapi.json: every
operation gets up to --max-examples generated requests (valid and invalid bodies, odd
headers, boundary values) and the check is that none is answered with a 5xx.

    nice -n 10 .venv/bin/python benchmarks/schemathesis_server.py --max-examples 300

Starts `ellm`'s app under uvicorn on a free port with the real SmolLM2 model (a small
context, so that the generated requests that are valid finish quickly), runs the
`schemathesis` CLI (pip install schemathesis) with the not_a_server_error check, and
prints its summary, the number of 5xx answers the server itself counted (its /metrics),
and any traceback in the server's log. Exit status: 0 when there was no 5xx.
"""
from __future__ import annotations

import argparse
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

_LAUNCH = r"""
import sys, uvicorn, ellm
from ellm.server import create_app
from ellm.server.timeouts import header_timeout_protocol
llm = ellm.load(sys.argv[1], max_model_len=int(sys.argv[3]), max_num_seqs=8, progress=False)
app = create_app(llm, served_model_name="m", max_queue=64)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", http=header_timeout_protocol(10))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_5xx(url: str) -> int:
    """5xx answers counted by the server's ellm_requests metric (all routes)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    total = 0
    for line in text.splitlines():
        m = re.match(r'ellm_requests_total\{.*status="5\d\d".*\} ([0-9.e+]+)', line)
        if m:
            total += int(float(m.group(1)))
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-examples", type=int, default=300, help="examples per operation")
    ap.add_argument("--max-model-len", type=int, default=16, help="the server's context (bounds each generation)")
    ap.add_argument("--phases", default="examples,coverage,fuzzing")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which("schemathesis")
    if exe is None:
        print("schemathesis is not installed: pip install schemathesis", file=sys.stderr)
        return 2
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="ellm-schemathesis-")) / "server.log"
    with open(log, "wb") as f:
        server = subprocess.Popen([sys.executable, "-c", _LAUNCH, args.model, str(port), str(args.max_model_len)],
                                  stdout=f, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            if server.poll() is not None:
                print(log.read_text()[-3000:], file=sys.stderr)
                return 2
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        t0 = time.perf_counter()
        run = subprocess.run([exe, "--no-color", "run", url + "/openapi.json", "--checks", "not_a_server_error",
                              "--max-examples", str(args.max_examples), "--phases", args.phases,
                              "--seed", str(args.seed), "--request-timeout", "120", "--workers", "1",
                              "--suppress-health-check", "all"],
                             capture_output=True, text=True, check=False, cwd=log.parent)  # (its reports go there)
        seconds = time.perf_counter() - t0
        five_xx = _server_5xx(url)
    finally:
        server.terminate()
        server.wait(30)
    out = run.stdout + run.stderr
    print("\n".join(out.splitlines()[-40:]))
    tracebacks = log.read_text().count("Traceback")
    print(f"\nschemathesis exit {run.returncode} after {seconds:.0f} s; the server counted {five_xx} 5xx answers; "
          f"{tracebacks} tracebacks in its log ({log})")
    return 0 if run.returncode == 0 and five_xx == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
