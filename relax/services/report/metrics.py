"""What a user sees of a run: per-role metric records, JSONL, TensorBoard events, PNG curves, an HTML page.

Each role appends its step metrics as records of its own log under
``<run>/metrics/<role>/<incarnation>/`` (one writer each, like every log in Relax, so it
works on S3 and across processes). :func:`read_metrics` folds them; :func:`export_report`
writes ``<run>/report/{metrics.jsonl, events.out.tfevents.relax, curves.png, report.html}``.

The TensorBoard file is written by hand (TFRecord framing + the two protobuf messages it
needs: Event and Summary.Value) so the CPU install stays free of tensorflow/tensorboard.
"""

from __future__ import annotations

import io
import json
import resource
import struct
import sys
import time
from typing import Any

import google_crc32c

from relax import objstore
from relax.services.report.accuracy import ACCURACY_FILE
from relax.services.report.curves import render_curves
from relax.services.report.page import report_html
from relax.transfer.writers import RecordLog, new_incarnation, read_records

# critic: only when algorithm.advantage=gae; reference: only with algorithm.reference_role; teacher: only
# with algorithm.distill_coef
ROLES = ("rollout", "advantage", "actor", "critic", "reference", "reward", "teacher")


class SystemGauge:
    """The process's own system metrics, sent with every record (trackers get them as ``<role>/sys_*``
    with no bookkeeping of their own): its peak resident memory and the CPU it used since the last
    record, in cores (2.0 = two cores busy all along)."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.monotonic(), time.process_time()

    def read(self) -> dict[str, float]:
        wall, cpu = time.monotonic(), time.process_time()
        used = (cpu - self.cpu) / max(wall - self.wall, 1e-6)
        self.wall, self.cpu = wall, cpu
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        peak_mb = peak / 2**20 if sys.platform == "darwin" else peak / 1024
        return {"sys_cpu_cores": round(used, 3), "sys_peak_rss_mb": round(peak_mb, 1)}


class MetricsLog:
    def __init__(self, run_url: str, role: str):
        self.log = RecordLog(objstore.join(run_url, "metrics", role, new_incarnation()))
        self.gauge = SystemGauge()

    def append(self, metrics: dict[str, Any]) -> None:
        self.log.append({"time": time.time(), **metrics, **self.gauge.read()})


class RoleLogs:
    """One metrics log per role name, opened on its first record (a stage may report for two)."""

    def __init__(self, run_url: str):
        self.run_url, self.logs = run_url, {}

    def append(self, metrics: dict[str, Any]) -> None:
        role = metrics["role"]
        if role not in self.logs:
            self.logs[role] = MetricsLog(self.run_url, role)
        self.logs[role].append(metrics)


class MetricsReader:
    """Follows one role's records; each ``new()`` reads only what was appended since the last
    call (a controller polling a long run must not re-read every record each time)."""

    def __init__(self, run_url: str, role: str):
        self.base = objstore.join(run_url, "metrics", role)
        self._next: dict[str, int] = {}

    def new(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for inc in objstore.list_dir(self.base):
            for seq, record in read_records(objstore.join(self.base, inc), self._next.get(inc, 0)):
                out.append(record)
                self._next[inc] = seq + 1
        return sorted(out, key=lambda r: r["time"])


def read_metrics(run_url: str, role: str) -> list[dict[str, Any]]:
    """Every record of ``role`` across its incarnations, in time order."""
    return MetricsReader(run_url, role).new()


def read_all_metrics(run_url: str) -> dict[str, list[dict[str, Any]]]:
    """Every role's records. With the reward role (data.reward_role) each rollout batch gets the
    reward figures the reward role measured for it (its step s is rollout batch s), so reports
    and curves read rewards in one place whoever scored them."""
    return merge_reward_role({role: read_metrics(run_url, role) for role in ROLES})


def merge_reward_role(by_role: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Give each rollout batch of ``by_role`` the reward figures the reward role measured for it (in place)."""
    scored = {m["step"]: m for m in by_role.get("reward", [])}
    for m in by_role.get("rollout", []):
        r = scored.get(m["batch"])
        if r is not None and "reward" not in m:
            m.update({k: v for k, v in r.items() if k == "reward_errors" or k.startswith("reward")})
    return by_role


# -- TensorBoard event file -------------------------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint((number << 3) | wire) + payload


def _bytes_field(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def _event(wall_time: float, step: int, scalars: dict[str, float] | None = None, version: str | None = None) -> bytes:
    msg = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
    if version is not None:
        msg += _bytes_field(3, version.encode())
    if scalars:  # Event.summary (5) -> Summary.value (1) -> {tag (1), simple_value (2, float)}
        values = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", v)))
                          for tag, v in scalars.items())
        msg += _bytes_field(5, values)
    return msg


def _masked_crc(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _record(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", _masked_crc(header)) + data + struct.pack("<I", _masked_crc(data))


def tfevents_bytes(rows: list[tuple[float, int, dict[str, float]]]) -> bytes:
    """A TensorBoard event file: ``rows`` of (wall time, step, {tag: value})."""
    buf = io.BytesIO()
    buf.write(_record(_event(rows[0][0] if rows else time.time(), 0, version="brain.Event:2")))
    for wall, step, scalars in rows:
        buf.write(_record(_event(wall, step, scalars)))
    return buf.getvalue()


# -- report ------------------------------------------------------------------------------------
def scalar_rows(records: list[dict[str, Any]], step_key: str, prefix: str) -> list[tuple[float, int, dict[str, float]]]:
    rows = []
    for r in records:
        scalars = {f"{prefix}/{k}": float(v) for k, v in r.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("time", step_key)}
        rows.append((r["time"], int(r.get(step_key, 0)), scalars))
    return rows


def export_report(run_url: str, by_role: dict[str, list[dict[str, Any]]], tensorboard: bool = True) -> dict[str, str]:
    """Write ``by_role`` (:func:`read_all_metrics`) as JSONL, a TensorBoard event file (unless
    ``tensorboard`` is off: report.trackers), PNG curves and an HTML page under ``<run>/report/``,
    with the held-out accuracy once the run has been evaluated (``accuracy.json``); returns their URLs."""
    report = objstore.join(run_url, "report")
    accuracy_url = objstore.join(report, ACCURACY_FILE)
    accuracy = json.loads(objstore.read_bytes(accuracy_url)) if objstore.exists(accuracy_url) else None
    lines = sorted((r for rs in by_role.values() for r in rs), key=lambda r: r["time"])
    urls = {
        "jsonl": objstore.join(report, "metrics.jsonl"),
        "tfevents": objstore.join(report, "events.out.tfevents.relax"),
        "png": objstore.join(report, "curves.png"),
        "html": objstore.join(report, "report.html"),
    }
    objstore.write_bytes(urls["jsonl"], "".join(json.dumps(r, sort_keys=True) + "\n" for r in lines).encode())
    if tensorboard:
        rows = (scalar_rows(by_role["actor"], "step", "actor") + scalar_rows(by_role["rollout"], "batch", "rollout")
                + scalar_rows(by_role.get("critic", []), "step", "critic"))
        objstore.write_bytes(urls["tfevents"], tfevents_bytes(sorted(rows, key=lambda r: r[0])))
    else:
        del urls["tfevents"]
    png = render_curves(by_role, accuracy)
    objstore.write_bytes(urls["png"], png)
    run_id = run_url.rstrip("/").split("/")[-1]
    objstore.write_bytes(urls["html"], report_html(run_id, png, by_role, accuracy).encode())
    return urls


def write_report(run_url: str, tensorboard: bool = True) -> dict[str, str]:
    """Read every role's records and (re)write the report from them: what ``relax report`` does."""
    return export_report(run_url, read_all_metrics(run_url), tensorboard)
