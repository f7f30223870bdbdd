"""Tests that the example scripts run."""
