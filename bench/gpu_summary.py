"""gpu_run.sh's results file: one JSON object, rewritten whole after each stage, so a run cut by its
time limit returns every stage it finished.

    python bench/gpu_summary.py FILE device                   the machine: device, torch, date
    python bench/gpu_summary.py FILE stage NAME RC T0          NAME exited RC, started at epoch T0
    python bench/gpu_summary.py FILE attach NAME JSON          JSON's content under NAME (absent: nothing)
    python bench/gpu_summary.py FILE training RUNS             each drafter's last training events in RUNS/*/
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> None:
    path, what, *args = argv
    out = Path(path)
    report = json.loads(out.read_text()) if out.exists() else {"stages": {}}
    if what == "device":
        import torch

        cuda = torch.cuda.is_available()
        report["device"] = {"name": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    elif what == "stage":
        name, rc, t0 = args
        report["stages"][name] = {"status": "ok" if rc == "0" else "timed out" if rc == "124" else f"exit {rc}",
                                  "seconds": round(time.time() - float(t0), 1)}
    elif what == "attach":
        name, source = args
        if Path(source).is_file() and Path(source).stat().st_size:
            text = Path(source).read_text().strip()
            try:  # a JSON file, or a command's output whose last line is one
                report[name] = json.loads(text)
            except ValueError:
                try:
                    report[name] = json.loads(text.splitlines()[-1])
                except ValueError:
                    report[name] = {"unreadable": text[-2000:]}
    elif what == "training":
        report["training"] = {}
        for log in sorted(Path(args[0]).glob("*/train_log.jsonl")):
            events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
            report["training"][log.parent.name] = [e for e in events if e["event"] in ("plan", "end", "stopped")]
    else:
        raise SystemExit(f"unknown action {what!r}")
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
