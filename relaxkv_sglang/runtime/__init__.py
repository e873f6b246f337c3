"""The bottom layer under every room: records on SGLang's objects (:mod:`.records`), failures
(:mod:`.failures`), the ``RELAXKV_*`` settings (:mod:`.settings`). Standard library only."""
