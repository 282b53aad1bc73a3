"""Reading back what an offline Weights & Biases run wrote (tests only)."""

import json
import struct
from pathlib import Path


def wandb_offline_records(run_folder: Path) -> list:
    """The records of an offline run's .wandb file, as wandb's protobuf Records.

    wandb >= 0.19 writes the file from its Go core and ships no Python reader of it: the file is a LevelDB
    log (32 KiB blocks of chunks, each behind a 7-byte header: CRC, length, type) after a 7-byte ":W&B"
    header, each record one `wandb_internal_pb2.Record`, so a test reads it back in these few lines."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_folder.glob("run-*.wandb")
    data, block, position, pending, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        left = block - position % block
        length, kind = struct.unpack("<HB", data[position + 4 : position + 7])
        if left < 7 or (length == 0 and kind == 0):  # a block's padding
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_folder: Path) -> dict[int, dict]:
    """{step: {key: value}} of everything an offline run logged."""
    history = {}
    for record in wandb_offline_records(run_folder):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(int(items["_step"]), {}).update(items)
    return history
