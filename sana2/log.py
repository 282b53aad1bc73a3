"""The project logger: rank-aware, one line per record, in torchtitan's style."""

import logging
import os

logger = logging.getLogger("sana2")


def init_logger() -> None:
    rank = os.environ.get("RANK", "0")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
