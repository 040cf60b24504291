"""The reproduction of Parcae's claims at CPU scale: studies that train small models, evaluate them and fit the
paper's laws, and a report (docs/reproduction.md) in which every number names the run artifact it was read from.

`python -m megaloop repro --help` runs it. megaloop.repro.study says what a study is.
"""
