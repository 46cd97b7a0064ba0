"""Screenshot an `rlsearch inspect --html` page in headless Chromium, to look at it without a desktop.

Not part of the test suite (the tests check the page's structure with the standard library): this needs playwright
and a browser, which the project does not depend on. Any request the page makes beyond its own file is blocked and
reported (the page must be self-contained), and so are console errors.

  pip install playwright && playwright install chromium
  python scripts/screenshot_inspect.py RUN/inspect/step_000002.html                 # -> step_000002.png
  python scripts/screenshot_inspect.py PAGE.html --element traj-3 --out /tmp/t3.png   # one trajectory
  python scripts/screenshot_inspect.py PAGE.html --browser /usr/bin/chromium        # a system Chromium
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

INSTALL = "install playwright and its Chromium: pip install playwright && playwright install chromium"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("page", help="an HTML page written by rlsearch inspect --html")
    parser.add_argument("--out", help="PNG path (default: the page's path with .png)")
    parser.add_argument("--element", metavar="ID", help="only this element, e.g. traj-3 (the page's trajectory 3)")
    parser.add_argument("--full-page", action="store_true", help="the whole page, not its first screen")
    parser.add_argument("--width", type=int, default=1280, help="viewport width in pixels (default 1280)")
    parser.add_argument("--browser", help="a Chromium executable instead of playwright's own")
    args = parser.parse_args(argv)

    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        print(f"screenshot_inspect: playwright is not installed; {INSTALL}", file=sys.stderr)
        return 2
    page_path = Path(args.page).resolve()
    if not page_path.is_file():
        print(f"screenshot_inspect: no such page: {page_path}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else page_path.with_suffix(".png")

    with sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(executable_path=args.browser)
        except Error as error:
            reason = str(error).strip().splitlines()[0]
            print(f"screenshot_inspect: Chromium does not start ({reason}); {INSTALL}", file=sys.stderr)
            return 2
        page = browser.new_page(viewport={"width": args.width, "height": 900})
        external, console_errors = [], []
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                   else (external.append(route.request.url), route.abort()))
        page.on("console", lambda message: message.type == "error" and console_errors.append(message.text))
        page.goto(page_path.as_uri())
        if args.element:
            page.locator(f"#{args.element}").screenshot(path=str(out))
        else:
            page.screenshot(path=str(out), full_page=args.full_page)
        browser.close()
    print(f"screenshot written to {out}")
    for url in external:
        print(f"screenshot_inspect: the page requested {url} (blocked): it is not self-contained", file=sys.stderr)
    for text in console_errors:
        print(f"screenshot_inspect: console error: {text}", file=sys.stderr)
    return 1 if external or console_errors else 0


if __name__ == "__main__":
    sys.exit(main())
