"""What people read: `render` writes the HTML and markdown reports of a run's result JSON, `view`
computes what they show, `plots` draws it, `matrix` writes the conformance matrix of several targets."""
