// The startup check that a trainer's parameter registry, its optimizer table and its update order
// name the same parameters, each exactly once (upstream asserts the same), given as lists of names.
#pragma once
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

// Why the optimizer table, the work order and the registry disagree, or "" when every registered
// parameter has exactly one table row and one place in the work order (upstream asserts the same at
// startup). An empty name is a missing work-order entry.
inline std::string param_table_error(const std::vector<std::string>& registry,
                                     const std::vector<std::string>& table, const std::vector<std::string>& order) {
    std::string out;
    for (const auto& [what, names] : {std::pair{"param_table", &table}, std::pair{"work_order", &order}}) {
        for (size_t i = 0; i < names->size(); ++i) {
            const std::string& name = (*names)[i];
            if (name.empty()) out += std::string(what) + " entry " + std::to_string(i) + " is empty; ";
            else if (std::find(registry.begin(), registry.end(), name) == registry.end())
                out += std::string(what) + " names '" + name + "', which is no registered parameter; ";
            else if (std::find(names->begin(), names->begin() + i, name) != names->begin() + i)
                out += std::string(what) + " names '" + name + "' twice; ";
        }
        for (const std::string& name : registry)
            if (std::find(names->begin(), names->end(), name) == names->end())
                out += std::string(what) + " lacks the registered parameter '" + name + "'; ";
    }
    return out.empty() ? out : out.substr(0, out.size() - 2);
}
