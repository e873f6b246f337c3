"""The server: the startup gate's verdict (:mod:`.gate`) and launching SGLang with the plugin
(:mod:`.launch`, :mod:`.cluster`). No SGLang import (its adapter, the plugin SGLang loads:
:mod:`.sglang`)."""
