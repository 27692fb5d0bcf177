"""Every test under tests/gpu is marked `gpu` and skipped on machines without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before `-m "not gpu"` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
