import logging
import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def data_dir() -> Path:
    return DATA


@pytest.fixture
def sana2_log(caplog):
    """What sana2's logger writes at INFO and above, as caplog.text."""
    caplog.set_level(logging.INFO, logger="sana2")
    logging.getLogger("sana2").propagate = True  # init_logger turns it off; caplog listens at the root
    yield caplog
    logging.getLogger("sana2").propagate = False
