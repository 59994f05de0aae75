"""The report: TensorBoard framing (CRC-checked records, protobuf fields) and PNG curves."""

from __future__ import annotations

import io
import struct
import time

from PIL import Image

from relax.services.report.curves import render_curves
from relax.services.report.metrics import SystemGauge, _masked_crc, tfevents_bytes


def _records(blob: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(blob):
        (n,) = struct.unpack_from("<Q", blob, i)
        assert struct.unpack_from("<I", blob, i + 8)[0] == _masked_crc(blob[i:i + 8])
        data = blob[i + 12:i + 12 + n]
        assert struct.unpack_from("<I", blob, i + 12 + n)[0] == _masked_crc(data)
        out.append(data)
        i += 16 + n
    return out


def test_tfevents_records_frame_and_encode_scalars():
    recs = _records(tfevents_bytes([(100.0, 3, {"actor/loss": 0.5})]))
    assert len(recs) == 2
    assert b"brain.Event:2" in recs[0]
    ev = recs[1]
    assert ev[:1] == b"\x09" and struct.unpack_from("<d", ev, 1)[0] == 100.0  # field 1, fixed64: wall_time
    assert ev[9:11] == b"\x10\x03"  # field 2, varint: step 3
    assert b"actor/loss" in ev and struct.pack("<f", 0.5) in ev  # Summary.Value tag + simple_value


def test_masked_crc_matches_the_tfrecord_definition():
    # TFRecord's mask: rotate right by 15 and add 0xa282ead8; crc32c(b"") == 0 -> mask(0) == 0xa282ead8
    assert _masked_crc(b"") == 0xA282EAD8


def test_curves_png_has_eight_panels():
    rollout = [{"batch": i, "reward": i / 10, "reward/arithmetic": i / 10} for i in range(5)]
    actor = [{"step": i, "loss": 1 - i / 10, "staleness_max": 1, "staleness_mean": 0.5} for i in range(5)]
    img = Image.open(io.BytesIO(render_curves({"rollout": rollout, "actor": actor})))
    assert img.format == "PNG" and img.size == (2 * 560 + 10, 4 * 300 + 3 * 10)  # 2 columns x 4 rows
    assert len(img.convert("RGB").getcolors(maxcolors=1 << 20)) > 3  # lines were drawn, not a blank canvas


def test_the_system_gauge_measures_cpu_used_since_its_last_reading():
    gauge = SystemGauge()
    time.sleep(0.2)
    idle = gauge.read()
    end = time.process_time() + 0.2
    while time.process_time() < end:  # 0.2 s of this process's own CPU
        pass
    busy = gauge.read()
    assert 0 <= idle["sys_cpu_cores"] < busy["sys_cpu_cores"]
    assert busy["sys_peak_rss_mb"] >= idle["sys_peak_rss_mb"] > 10
