"""The plugin SGLang loads: registrations and the hook table (:mod:`.plugin`), the startup wiring
(:mod:`.startup`), the startup gate on the loaded model (:mod:`.gate`)."""
