#!/usr/bin/env python3
"""The fovea-attn wheel of this build (issue 47): scripts/python-wheel.sh builds it from BUILD's
libfovea_attn.so, then its tags are read back (scripts/wheel-tag.py check): never none-any with a .so
inside; manylinux_2_<M>_<arch> from the library's highest GLIBC_2.M and ELF machine (M compared with
readelf's reading where binutils is installed); +cu<XY> exactly when the library holds CUDA code; RECORD
hashes. Then the check must refuse planted wheels: none-any with the library, the wrong local version,
a file changed behind RECORD, a name whose tag WHEEL does not say. A few seconds, no network.
  python-wheel-test.py --build BUILD --tmp DIR
"""
import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("wheel_tag", os.path.join(ROOT, "scripts", "wheel-tag.py"))
wt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wt)
failures = []


def expect(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)


def refused(path, build, why):
    try:
        wt.check(path, build)
    except wt.TagError as e:
        expect(re.search(why, str(e)) is not None, f"refused: {os.path.basename(path)}: {e}")
        return
    expect(False, f"{os.path.basename(path)} passed the check; expected a refusal matching {why!r}")


def rewrite(src, dst, version=None, change=None):
    """A copy of wheel src at dst: its version (METADATA, dist-info folder) set to version, or one
    file's bytes replaced (change = (name, bytes)); RECORD left as it was."""
    m, entries, dist_info = wt.read_wheel(src)
    new_info = f"{m['dist']}-{version}.dist-info/" if version else dist_info
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as z:
        for info, data in entries:
            name = info.filename
            if version and name == dist_info + "METADATA":
                data = re.sub(rb"^Version: .*$", b"Version: " + version.encode(), data, flags=re.M)
            if change and name == change[0]:
                data = change[1]
            info.filename = new_info + name[len(dist_info):] if name.startswith(dist_info) else name
            z.writestr(info, data)
    return dst


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", required=True)
    p.add_argument("--tmp", required=True)
    a = p.parse_args()
    shutil.rmtree(a.tmp, ignore_errors=True)
    os.makedirs(a.tmp)
    run = subprocess.run([os.path.join(ROOT, "scripts", "python-wheel.sh"), a.build, os.path.join(a.tmp, "dist")],
                         capture_output=True, text=True)
    sys.stdout.write(run.stderr)
    if run.returncode != 0:
        print(run.stdout)
        print("FAIL  scripts/python-wheel.sh exited with", run.returncode)
        return 1
    whl = run.stdout.strip().splitlines()[-1]
    name = os.path.basename(whl)
    print("wheel:", name)
    m = wt.WHEEL_NAME.fullmatch(name)
    expect(m is not None and m["dist"] == "fovea_attn", f"the distribution is fovea_attn ({name})")
    expect(m is not None and not name.endswith("-none-any.whl"), "not tagged none-any")

    lib = os.path.realpath(os.path.join(a.build, "libfovea_attn.so"))
    with open(lib, "rb") as f:
        info = wt.elf_info(f.read(), lib)
    plat = wt.platform_tag(info)
    expect(m["plat"] == plat, f"platform {m['plat']} is the library's {plat}")
    if shutil.which("readelf"):
        out = subprocess.run(["readelf", "--version-info", "-W", lib], capture_output=True, text=True).stdout
        glibc = max((int(x) for x in re.findall(r"\bGLIBC_2\.(\d+)", out)), default=0)
        expect(info["glibc"] == (2, glibc), f"GLIBC_2.{info['glibc'][1]} is readelf's highest, GLIBC_2.{glibc}")
    local = m["version"].partition("+")[2]
    if wt.has_cuda(info):
        expect(bool(re.fullmatch(r"cu\d+", local)), f"a CUDA library: local version +{local}")
    else:
        expect(local == "", f"a CPU-only library: no local version ({m['version']})")
    try:
        expect(True, "check: " + wt.check(whl, a.build))
    except wt.TagError as e:
        expect(False, f"check: {e}")

    plants = os.path.join(a.tmp, "plants")
    os.makedirs(plants)
    base = m["version"].partition("+")[0]
    # none-any with the library inside (the tag python-wheel.sh gave before issue 47)
    any_whl = shutil.copy(whl, plants)
    refused(wt.retag(any_whl, "any"), a.build, r"none-any")
    # the local version rule broken: +cu130 on a CPU library, none on a CUDA one
    wrong = base if local else base + "+cu130"
    planted = rewrite(whl, os.path.join(plants, f"fovea_attn-{wrong}-py3-none-{plat}.whl"), version=wrong)
    refused(wt.retag(planted, plat), a.build, r"local version")
    # a file changed behind RECORD
    _, entries, _ = wt.read_wheel(whl)
    so = next(i.filename for i, _ in entries if ".so" in i.filename)
    os.makedirs(os.path.join(plants, "changed"))
    planted = rewrite(whl, os.path.join(plants, "changed", name), change=(so, b"\x7fELF not the library"))
    refused(planted, a.build, r"RECORD")
    # a file name whose platform WHEEL does not say
    other = os.path.join(plants, name.replace(plat, plat.replace("manylinux_2_", "manylinux_2_9")))
    shutil.copy(whl, other)
    refused(other, a.build, r"WHEEL says Tag")

    print("python-wheel-test:", "FAILED: " + "; ".join(failures) if failures else "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
