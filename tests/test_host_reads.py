"""The host-read counter (tests/host_reads.py) itself: one planted read of every kind it claims
is counted once, from project code; what is not a read, or is a test's own read, is not."""
import importlib
import sys

import pytest
import torch

from tests.host_reads import HostReads

# One function per kind of read, in a module that stands for project code.
PLANTED = '''
import numpy
import torch

x = torch.arange(6.0)
mask = torch.tensor([True, False, True, False, True, True])
index = torch.tensor([0, 2, 2, 3])

READS = {
    "item": lambda: x[1].item(),
    "float": lambda: float(x[1]),
    "int": lambda: int(index[0]),
    "bool": lambda: bool(mask.any()),
    "an index": lambda: [0, 1, 2, 3][index[1]],
    "equal": lambda: torch.equal(x, x),
    "tolist": lambda: x.tolist(),
    "numpy": lambda: x.numpy(),
    "asarray": lambda: numpy.asarray(x),
    "repr": lambda: repr(x),
    "f-string": lambda: f"{x}",
    "cpu": lambda: x.cpu(),
    "to cpu": lambda: x.to("cpu"),
    "to a cpu device": lambda: x.to(device=torch.device("cpu"), dtype=torch.float64),
    "boolean mask": lambda: x[mask],
    "boolean mask set": lambda: x.clone().__setitem__(mask, 1.0),
    "nonzero": lambda: mask.nonzero(),
    "where": lambda: torch.where(mask),
    "masked_select": lambda: x.masked_select(mask),
    "unique": lambda: torch.unique(index),
    "unique_consecutive": lambda: torch.unique_consecutive(index),
    "bincount": lambda: torch.bincount(index),
    "repeat_interleave": lambda: torch.repeat_interleave(x[:4], index),
    "histc": lambda: torch.histc(x, 4),
}
NOT_READS = {
    "repeat_interleave with output_size": lambda: torch.repeat_interleave(x[:4], index, output_size=7),
    "histc over a given range": lambda: torch.histc(x, 4, min=0, max=6),
    "an integer index": lambda: x[index],
    "a mask applied by where": lambda: torch.where(mask, x, 0.0),
    "to a dtype": lambda: x.to(torch.float64),
    "to a host tensor's device, non_blocking": lambda: x.to("cpu", non_blocking=True),
    "a reduction": lambda: (x != 0).any(),
}
'''
KINDS = {"item": "item", "float": "item", "int": "item", "bool": "item", "an index": "item", "equal": "equal",
         "tolist": "tolist", "numpy": "numpy", "asarray": "numpy", "repr": "repr", "f-string": "repr", "cpu": "cpu",
         "to cpu": "to", "to a cpu device": "to", "boolean mask": "boolean mask", "boolean mask set": "boolean mask",
         "nonzero": "nonzero", "where": "nonzero", "masked_select": "masked_select", "unique": "unique",
         "unique_consecutive": "unique", "bincount": "bincount", "repeat_interleave": "repeat_interleave",
         "histc": "histc"}


@pytest.fixture
def planted(tmp_path, monkeypatch):
    (tmp_path / "planted.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("planted", None)
    yield importlib.import_module("planted"), tmp_path
    sys.modules.pop("planted", None)


def test_every_kind_of_read_from_project_code_counts_once(planted):
    module, project = planted
    assert set(module.READS) == set(KINDS)
    for name, read in module.READS.items():
        with HostReads(project=project) as reads:
            read()
        assert reads.kinds() == [KINDS[name]], (name, reads.reads)
        if reads.reads[0][1] != "aten":
            assert reads.reads[0][1].startswith("planted.py:"), reads.reads
    for name, not_a_read in module.NOT_READS.items():
        with HostReads(project=project) as reads:
            not_a_read()
        assert reads.reads == [], (name, reads.reads)


def test_a_tests_own_python_reads_do_not_count_and_the_methods_come_back(planted):
    module, project = planted
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "to", "numpy", "__repr__")}
    with HostReads(project=project) as reads:
        module.x.tolist(), module.x.cpu(), module.x.to("cpu")
    assert reads.reads == []
    assert {name: getattr(torch.Tensor, name) for name in originals} == originals


def test_only_model_values_counts_what_a_parameter_computed(planted):
    module, project = planted
    weight = torch.ones(6, requires_grad=True)
    with HostReads(project=project, of_model_values_only=True) as reads:
        module.READS["tolist"]()  # the module's own host tensor: no wait on a device
        module.x = module.x * weight  # now computed from a parameter
        module.READS["tolist"](), module.READS["cpu"](), module.READS["item"]()
    assert reads.kinds() == ["tolist", "cpu", "item"], reads.reads
