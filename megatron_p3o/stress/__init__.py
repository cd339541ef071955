"""Precision-mismatch stress experiments: ``python -m megatron_p3o.stress GRID.yaml``.

grid.py (the grid file → cells) → runner.py (train each cell, resumably) → report.py (CSV, PNG
plots, markdown report).
"""
