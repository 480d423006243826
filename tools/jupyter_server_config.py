# JupyterLab settings of this project: `make lab` starts Lab with this file (jupyter lab --config=...).
# A notebook is saved the way `nbdev_clean` leaves it, so opening and saving one without an edit changes nothing:
# nbdev's own save hook (settings.ini: jupyter_hooks = True) strips what nbdev_clean strips, and the kernelspec is put
# back to the one every notebook of the project declares (Lab would write its display name, "Python 3 (ipykernel)").
# The hook is registered on the contents manager (`register_pre_save_hook`), beside any `pre_save_hook` a user's own
# Jupyter config sets (nbdev_install_hooks writes one), instead of replacing it with a warning.
import os

from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

CANONICAL_KERNELSPEC = {'display_name': 'python3', 'language': 'python', 'name': 'python3'}


def oelm_clean_on_save(model, path, contents_manager, **kwargs):
    "Clean a notebook model before Jupyter writes it (a no-op for other files and when nbdev is missing)."
    content = model.get('content') or {}
    if model.get('type') != 'notebook' or content.get('nbformat') != 4: return
    try: from nbdev.clean import clean_jupyter, clean_nb
    except ModuleNotFoundError: return
    from nbdev.config import get_config
    os_path = contents_manager._get_os_path(path)
    if os.path.exists(os_path): clean_jupyter(path=os_path, model=model)  # nbdev's hook: clean, then trust the file
    else:  # a new notebook (Lab's Untitled.ipynb): no file yet for nbdev's hook to trust; cleaned as nbdev_clean cleans
        get_config.cache_clear()
        cfg = get_config(path=os.path.dirname(os_path))
        if cfg.jupyter_hooks:
            clean_nb(content, cfg.clear_all, cfg.get('allowed_metadata_keys', '').split(),
                     cfg.get('allowed_cell_metadata_keys', '').split(), cfg.clean_ids)
    meta = content.setdefault('metadata', {})
    if (meta.get('kernelspec') or {}).get('name') == 'python3': meta['kernelspec'] = dict(CANONICAL_KERNELSPEC)


class OelmContentsManager(AsyncLargeFileManager):
    "Jupyter's default contents manager with `oelm_clean_on_save` registered as a pre-save hook."
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.register_pre_save_hook(oelm_clean_on_save)


c.ServerApp.contents_manager_class = OelmContentsManager  # noqa: F821 (`c` is the config object Jupyter provides)
