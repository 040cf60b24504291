"""The five studies of the reproduction, one module each; each module exposes STUDY, a megaloop.repro.study.Study."""
