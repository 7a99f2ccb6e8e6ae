"""Devices, launch and (in later work) the parallel layouts applied to a model from outside."""
