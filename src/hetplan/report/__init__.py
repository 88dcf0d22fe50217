"""Rendering: text tables, the HTML page and SVG pictures of what ``hetplan.app`` computes."""
