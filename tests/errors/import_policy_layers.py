"""Module of the import_policy.yaml error fixture: names that are not layers."""

from torch import nn


class _Gate(nn.Module):
    pass


class NotAModule:
    pass


def run():
    raise AssertionError("a function named by an op must never be called")


Alias = nn.Linear
