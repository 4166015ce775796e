"""Figures and pages: PNGs and self-contained HTML reports from results and run files."""
