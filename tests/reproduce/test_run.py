"""Pieces of ``mjp reproduce``'s runs that need no training."""

import os

import pytest
import torch

from mjp_fast.reproduce.run import describe_device


@pytest.mark.parametrize(
    ("cores", "threads", "words"), [(1, 1, "1 core, 1 torch thread"), (2, 2, "2 cores, 2 torch threads")]
)
def test_describe_device_counts_cores_and_threads_in_words(cores, threads, words, monkeypatch):
    # the smoke preset runs with threads=1: the report said "1 torch threads"
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    if hasattr(os, "sched_getaffinity"):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    else:
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert describe_device(torch.device("cpu")).endswith(f", {words}")
