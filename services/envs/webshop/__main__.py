"""Build the catalogue once: ``python -m services.envs.webshop [--env.data_dir=D] [--env.webshop.num_products=N]``."""

import json
import sys

from services.envs.webshop.catalog import build, catalog_path
from shared.config import from_argv
from shared.progress import ticking

cfg, _ = from_argv(sys.argv[1:])
with ticking("webshop catalogue"):
    built = build(catalog_path(cfg.env.data_dir, cfg.env.webshop.num_products), cfg.env.webshop.num_products)
print(json.dumps(built))
