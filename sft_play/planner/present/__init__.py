"""Presenting a plan: what it means in words, and the table, JSON and plot.

  notes.py      the plan's notes and warnings, in the user's terms
  report.py     table, JSON, plot
"""
