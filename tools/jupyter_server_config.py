# JupyterLab settings of this project: `make lab` starts Lab with this file (jupyter lab --config=...).
# A notebook is saved the way `nbdev_clean` leaves it, so opening and saving one without an edit changes nothing:
# nbdev's own save hook (settings.ini: jupyter_hooks = True) strips what nbdev_clean strips, and the kernelspec is put
# back to the one every notebook of the project declares (Lab would write its display name, "Python 3 (ipykernel)").
CANONICAL_KERNELSPEC = {'display_name': 'python3', 'language': 'python', 'name': 'python3'}

def oelm_clean_on_save(model, path, contents_manager, **kwargs):
    "Clean a notebook model before Jupyter writes it (a no-op for other files and when nbdev is missing)."
    content = model.get('content') or {}
    if model.get('type') != 'notebook' or content.get('nbformat') != 4: return
    try: from nbdev.clean import clean_jupyter
    except ModuleNotFoundError: return
    clean_jupyter(path=contents_manager._get_os_path(path), model=model)
    meta = content.setdefault('metadata', {})
    if (meta.get('kernelspec') or {}).get('name') == 'python3': meta['kernelspec'] = dict(CANONICAL_KERNELSPEC)

c.ContentsManager.pre_save_hook = oelm_clean_on_save  # noqa: F821 (`c` is the config object Jupyter provides)
