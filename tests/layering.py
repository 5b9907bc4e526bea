"""An import-linter contract type the built-in ones cannot express: "imports only the standard library"
(and, where a contract names them, a few allowed packages).

Registered in pyproject.toml ([tool.importlinter] contract_types) and checked by `lint-imports` in
scripts/test.sh with the other layering contracts. import-linter puts the working directory on sys.path,
so this module loads as `tests.layering` from the repository root.
"""

from __future__ import annotations

import sys

from grimp import ImportGraph
from importlinter import Contract, ContractCheck, fields, output


class StdlibOnlyContract(Contract):
    """Each of `modules` (with its descendants) imports only itself, the standard library and the
    packages of `allowed_modules` (with their descendants)."""

    type_name = "stdlib_only"

    modules = fields.ListField(subfield=fields.ModuleField())
    allowed_modules = fields.ListField(subfield=fields.ModuleField(), required=False)
    broken_contract_guidance = fields.StringField(required=False)

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        illegal: list[tuple[str, str, list[int]]] = []
        allowed = [m.name for m in self.allowed_modules or []]
        for package in self.modules:
            root = package.name
            for importer in sorted({root} | graph.find_descendants(root)):
                for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                    inside = any(imported == r or imported.startswith(r + ".") for r in [root, *allowed])
                    if inside or imported.split(".")[0] in sys.stdlib_module_names:
                        continue
                    details = graph.get_import_details(importer=importer, imported=imported)
                    illegal.append((importer, imported, [d["line_number"] for d in details]))
        return ContractCheck(kept=not illegal, metadata={"illegal": illegal})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for importer, imported, lines in check.metadata["illegal"]:
            output.print_error(f"- {importer} -> {imported} (l.{', '.join(map(str, lines))})", bold=False)
        output.new_line()
        guidance = self.broken_contract_guidance
        if guidance:
            output.print(guidance)
