//! The SPIR-V naga writes for a variant, produced as wgpu-hal's Vulkan backend does (override
//! constants applied for the one entry point, then `naga::back::spv::write_vec` with the
//! bounds-check policies of a trusted or checked module), and a scan of its words for what
//! could keep NVIDIA's compiler from registers: function-local arrays and the accesses into
//! them with non-constant indices, dynamic vector component accesses, loops and their unroll
//! hints, function calls.

use super::{wgsl, Kernel, Variant};
use naga::back::spv;

/// SPIR-V words of `variant` for the Vulkan version `lang` (wgpu-hal: 1.6 on Vulkan 1.3).
/// Trusted modules get no index clamps, no loop bounding and no integer-division guards;
/// checked ones wgpu-hal's defaults on a device with `robustBufferAccess2` (indices clamped,
/// buffer accesses left to the driver, loops bounded, divisions guarded). Errors: parse, validation or translation, as text.
pub fn words(variant: Variant, lang: (u8, u8)) -> Result<Vec<u32>, String> {
    let (src, constants) = match variant.kernel {
        Kernel::Tiled(t) => (wgsl::tiled(&t, variant.dtype), Vec::new()),
        Kernel::Ours(ml) => (wgsl::ours(ml), wgsl::ours_constants(ml, variant.dtype)),
    };
    let entry = wgsl::entry_point(matches!(variant.kernel, Kernel::Ours(_)));
    let module = naga::front::wgsl::parse_str(&src).map_err(|e| e.emit_to_string(&src))?;
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .map_err(|e| e.emit_to_string(&src))?;
    let constants: naga::back::PipelineConstants = constants
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let (m, i) = naga::back::pipeline_constants::process_overrides(
        &module,
        &info,
        Some((naga::ShaderStage::Compute, entry)),
        &constants,
    )
    .map_err(|e| format!("overrides: {e:?}"))?;
    use naga::proc::BoundsCheckPolicy::{Restrict, Unchecked};
    let index = if variant.checked { Restrict } else { Unchecked };
    let options = spv::Options {
        lang_version: lang,
        bounds_check_policies: naga::proc::BoundsCheckPolicies {
            index,
            buffer: Unchecked,
            image_load: Unchecked,
            binding_array: Unchecked,
        },
        zero_initialize_workgroup_memory: spv::ZeroInitializeWorkgroupMemoryMode::None,
        force_loop_bounding: variant.checked,
        emit_int_div_checks: variant.checked,
        ..Default::default()
    };
    let stage = spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: entry.into(),
    };
    spv::write_vec(&m, &i, &options, Some(&stage)).map_err(|e| format!("SPIR-V: {e:?}"))
}

/// What [`scan`] counts in a module.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Instructions.
    pub instructions: usize,
    /// `OpFunction`s (the entry point included).
    pub functions: usize,
    /// `OpFunctionCall`s.
    pub calls: usize,
    /// Function-storage variables.
    pub function_vars: usize,
    /// Function-storage variables of array type.
    pub function_arrays: usize,
    /// Access chains with a non-constant index into a function-storage array (a variable, or
    /// a pointer parameter to one).
    pub dynamic_function_array_chains: usize,
    /// Access chains with a non-constant index into other function-storage values (vectors).
    pub dynamic_function_other_chains: usize,
    /// Access chains into workgroup memory with a non-constant index (expected: the panels).
    pub dynamic_workgroup_chains: usize,
    /// `OpVectorExtractDynamic` and `OpVectorInsertDynamic`.
    pub dynamic_vector_ops: usize,
    /// Loops (`OpLoopMerge`), and those with the `Unroll` / `DontUnroll` hint.
    pub loops: usize,
    /// Loops hinted `Unroll`.
    pub unroll_hints: usize,
    /// Loops hinted `DontUnroll`.
    pub dont_unroll_hints: usize,
    /// GLSL.std.450 `Fma` instructions.
    pub fma: usize,
    /// `OpControlBarrier`s.
    pub barriers: usize,
}

impl std::fmt::Display for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} instr, {} functions, {} calls, {} function vars ({} arrays, {} dynamic \
             chains into them, {} into other function vars), {} dynamic workgroup chains, {} dynamic vector ops, {} loops \
             ({} unroll, {} dont-unroll hints), {} fma, {} barriers",
            self.instructions,
            self.functions,
            self.calls,
            self.function_vars,
            self.function_arrays,
            self.dynamic_function_array_chains,
            self.dynamic_function_other_chains,
            self.dynamic_workgroup_chains,
            self.dynamic_vector_ops,
            self.loops,
            self.unroll_hints,
            self.dont_unroll_hints,
            self.fma,
            self.barriers
        )
    }
}

const OP_EXT_INST_IMPORT: u32 = 11;
const OP_EXT_INST: u32 = 12;
const OP_TYPE_ARRAY: u32 = 28;
const OP_TYPE_POINTER: u32 = 32;
const OP_CONSTANT: u32 = 43;
const OP_CONSTANT_COMPOSITE: u32 = 44;
const OP_CONSTANT_NULL: u32 = 46;
const OP_FUNCTION: u32 = 54;
const OP_FUNCTION_PARAMETER: u32 = 55;
const OP_FUNCTION_CALL: u32 = 57;
const OP_VARIABLE: u32 = 59;
const OP_ACCESS_CHAIN: u32 = 65;
const OP_IN_BOUNDS_ACCESS_CHAIN: u32 = 66;
const OP_VECTOR_EXTRACT_DYNAMIC: u32 = 77;
const OP_VECTOR_INSERT_DYNAMIC: u32 = 78;
const OP_CONTROL_BARRIER: u32 = 224;
const OP_LOOP_MERGE: u32 = 246;
const SC_WORKGROUP: u32 = 4;
const SC_FUNCTION: u32 = 7;
const GLSL_FMA: u32 = 50;

/// Count [`Stats`] in a SPIR-V module. Errors: not a SPIR-V module, or a truncated one.
pub fn scan(words: &[u32]) -> Result<Stats, String> {
    if words.len() < 5 || words[0] != 0x0723_0203 {
        return Err("not a SPIR-V module".into());
    }
    use std::collections::{HashMap, HashSet};
    let mut st = Stats::default();
    let mut arrays = HashSet::new();
    let mut pointers: HashMap<u32, (u32, u32)> = HashMap::new(); // id -> (class, pointee)
    let mut constants = HashSet::new();
    let mut fn_arrays = HashSet::new();
    let mut fn_other = HashSet::new();
    let mut workgroup = HashSet::new();
    let mut glsl = None;
    let mut at = 5;
    while at < words.len() {
        let (op, wc) = (words[at] & 0xffff, (words[at] >> 16) as usize);
        if wc == 0 || at + wc > words.len() {
            return Err(format!("truncated instruction at word {at}"));
        }
        let w = &words[at + 1..at + wc];
        st.instructions += 1;
        match op {
            OP_EXT_INST_IMPORT => {
                let name: Vec<u8> = w[1..].iter().flat_map(|x| x.to_le_bytes()).collect();
                if name.starts_with(b"GLSL.std.450") {
                    glsl = Some(w[0]);
                }
            }
            OP_EXT_INST if Some(w[2]) == glsl && w[3] == GLSL_FMA => st.fma += 1,
            OP_TYPE_ARRAY => {
                arrays.insert(w[0]);
            }
            OP_TYPE_POINTER => {
                pointers.insert(w[0], (w[1], w[2]));
            }
            OP_CONSTANT | OP_CONSTANT_COMPOSITE | OP_CONSTANT_NULL => {
                constants.insert(w[1]);
            }
            OP_FUNCTION => st.functions += 1,
            OP_FUNCTION_CALL => st.calls += 1,
            OP_FUNCTION_PARAMETER => {
                if let Some(&(SC_FUNCTION, pointee)) = pointers.get(&w[0]) {
                    if arrays.contains(&pointee) {
                        fn_arrays.insert(w[1]);
                    } else {
                        fn_other.insert(w[1]);
                    }
                }
            }
            OP_VARIABLE => {
                let (ty, id, class) = (w[0], w[1], w[2]);
                let pointee = pointers.get(&ty).map(|p| p.1);
                if class == SC_FUNCTION {
                    st.function_vars += 1;
                    if pointee.is_some_and(|p| arrays.contains(&p)) {
                        st.function_arrays += 1;
                        fn_arrays.insert(id);
                    } else {
                        fn_other.insert(id);
                    }
                } else if class == SC_WORKGROUP {
                    workgroup.insert(id);
                }
            }
            OP_ACCESS_CHAIN | OP_IN_BOUNDS_ACCESS_CHAIN => {
                let (base, idx) = (w[2], &w[3..]);
                let dynamic = idx.iter().any(|i| !constants.contains(i));
                if dynamic && fn_arrays.contains(&base) {
                    st.dynamic_function_array_chains += 1;
                }
                if dynamic && fn_other.contains(&base) {
                    st.dynamic_function_other_chains += 1;
                }
                if dynamic && workgroup.contains(&base) {
                    st.dynamic_workgroup_chains += 1;
                }
            }
            OP_VECTOR_EXTRACT_DYNAMIC | OP_VECTOR_INSERT_DYNAMIC => st.dynamic_vector_ops += 1,
            OP_CONTROL_BARRIER => st.barriers += 1,
            OP_LOOP_MERGE => {
                st.loops += 1;
                let control = w[2];
                if control & 1 != 0 {
                    st.unroll_hints += 1;
                }
                if control & 2 != 0 {
                    st.dont_unroll_hints += 1;
                }
            }
            _ => {}
        }
        at += wc;
    }
    Ok(st)
}

/// Write `words` to `path` as a little-endian `.spv` file.
pub fn write(path: &std::path::Path, words: &[u32]) -> std::io::Result<()> {
    std::fs::write(path, bytemuck::cast_slice::<u32, u8>(words))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_array_kernel_keeps_its_accumulator_indices_constant() {
        let v = Variant::parse("t128r8k8").unwrap();
        let st = scan(&words(v, (1, 6)).unwrap()).unwrap();
        assert_eq!(st.fma, 16, "{st}");
        assert_eq!(st.dynamic_function_array_chains, 0, "{st}");
        assert_eq!(st.barriers, 2, "{st}");
        let named = scan(&words(Variant::parse("t128r8k8n").unwrap(), (1, 6)).unwrap()).unwrap();
        assert_eq!(named.function_arrays, 0, "{named}");
        // The staging's `Pref` reached through a pointer parameter, indexed by a loop counter.
        let ours = scan(&words(Variant::parse("ours-scalar").unwrap(), (1, 6)).unwrap()).unwrap();
        assert!(
            ours.calls > 0 && ours.dynamic_function_array_chains > 0,
            "{ours}"
        );
        assert!(scan(&[1, 2, 3]).is_err());
    }
}
