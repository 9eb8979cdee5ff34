"""Read what an offline W&B run wrote (``<dir>/wandb/offline-run-*/run-<id>.wandb``).

wandb 0.31 no longer ships a Python reader for its run files, so tests read them here: the file is
a 7-byte header (``:W&B``, magic, version) followed by LevelDB-log-style records (CRC32C,
little-endian length, type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks, each record a
serialised ``wandb_internal_pb2.Record``."""
from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK = 32 * 1024
_HEADER = 7
_RECORD_HEADER = 7


def _payloads(data: bytes):
    pos, pending = _HEADER, b""
    while pos + _RECORD_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _RECORD_HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _RECORD_HEADER])
        chunk = data[pos + _RECORD_HEADER:pos + _RECORD_HEADER + length]
        pos += _RECORD_HEADER + length
        if kind == 0 and length == 0:  # zero padding
            continue
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def read_offline_run(run_file: str | Path) -> dict:
    """``{"run_id", "project", "history": [{key: value, ..., "_step": n}, ...]}`` of one run file."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{run_file}: not a W&B run file")
    out: dict = {"run_id": None, "project": None, "history": []}
    for payload in _payloads(data):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run_id"], out["project"] = record.run.run_id, record.run.project
        elif kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            out["history"].append(row)
    return out


def offline_runs(run_dir: str | Path, settle_s: float = 10.0) -> list[dict]:
    """Every offline run under ``<run_dir>/wandb``, oldest first. wandb's service process writes
    the files; a file read while it still flushes may lack its run record (seen once on the
    loaded 2-core box), so a file without one is read again for up to ``settle_s``."""
    import time

    files = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    deadline = time.monotonic() + settle_s
    while True:
        runs = [read_offline_run(f) for f in files]
        if all(r["run_id"] is not None for r in runs) or time.monotonic() >= deadline:
            return runs
        time.sleep(0.2)
