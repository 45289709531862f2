"""Dashboards for Jupyter (ipywidgets + plotly)."""
