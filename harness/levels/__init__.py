"""The levels, one module per routine family: each declares its `Level` object
(`harness.base.levels`), bundling its case class, contract functions, rank-side call, oracle,
judging, strategy and profile counts, and the evidence it gives the generic checks. A new level is a
new module here (with the case class, rank-side call, oracle and judge it names) and one entry of
`harness.base.levels.BUILTIN` (docs/architecture.md)."""
