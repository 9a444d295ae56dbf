"""Defines neither contract function."""


def something_else(x):
    return x
