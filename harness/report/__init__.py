"""What people read: `console` is what `check` prints, `result` the result JSON it writes, `render`
the HTML and markdown reports of that JSON, `view` computes what they show, `plots` draws it,
`matrix` writes the conformance matrix of several targets."""
