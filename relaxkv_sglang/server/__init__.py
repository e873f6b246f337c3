"""The server: its settings (:mod:`.settings`, every ``RELAXKV_*`` variable), the startup gate's
verdict (:mod:`.gate`), the plugin's failures and its state on SGLang's objects, and launching
SGLang with the plugin (:mod:`.launch`, :mod:`.cluster`). No SGLang import (its adapter, the
plugin SGLang loads: :mod:`.sglang`)."""
