"""`pagedllm audit-log FILE --tenant NAME`: one tenant's lines of a server's audit log."""

from __future__ import annotations

import argparse

from pagedllm.entrypoints.openai.audit_log import tenant_lines


def add_audit_log_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "audit-log",
        help="print one tenant's lines of a server's audit log (--audit-log)",
        description="Print one tenant's lines of a server's audit log, its rotated files "
        "included, oldest first.",
    )
    parser.add_argument("file", help="the audit log (as given to serve --audit-log)")
    parser.add_argument("--tenant", required=True, help="the tenant's name (keys file)")
    parser.set_defaults(handler=_print_tenant_lines)


def _print_tenant_lines(args: argparse.Namespace) -> int:
    for line in tenant_lines(args.file, args.tenant):
        print(line)
    return 0
