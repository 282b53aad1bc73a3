import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def data_dir() -> Path:
    return DATA
