"""Visualizers: render plans, traces, schedules and memory reports; compute nothing.

Matplotlib is imported inside the functions that draw, so importing workbench
stays light.
"""
