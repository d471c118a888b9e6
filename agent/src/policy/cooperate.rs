//! Autoscaler cooperation in the plan: which game-server pods get which annotations, and
//! where in the plan each patch goes.

use crate::cooperation;

use super::{Action, Inputs, Plan, Warning};

/// Autoscaler cooperation: the annotations each game-server pod on this node should carry
/// for its server's state (see `cooperation`). One patch per pod that needs one; none when
/// the mode is off and lastcall never wrote any. Protecting a match comes first in the plan:
/// an autoscaler re-reads the pod seconds after choosing the node, and a failed Node write
/// (a conflict) must not hold it back; giving protection up comes last.
pub(super) fn cooperate(inp: &Inputs<'_>, out: &mut Plan) {
    let obs = inp.observed;
    let mode = match cooperation::Mode::for_node(&obs.node.labels, inp.config.cooperation) {
        Ok(m) => m,
        Err(bad) => {
            out.warnings.push(Warning {
                reason: "CooperationLabelInvalid",
                note: format!(
                    "Node label {}={bad:?} is not off, in-use or all; using --autoscaler-cooperation={}",
                    cooperation::LABEL_MODE,
                    inp.config.cooperation.as_str()
                ),
            });
            inp.config.cooperation
        }
    };
    for gs in &obs.game_servers {
        if gs.deleting {
            continue;
        }
        let Some(pod) = obs.pod_of(gs).filter(|p| !p.deleting && !p.finished) else {
            continue;
        };
        let changes = cooperation::desired(gs, pod, mode);
        if changes.is_empty() {
            continue;
        }
        let protects = changes.get(cooperation::ANN_DO_NOT_DISRUPT) == Some(&Some("true".into()))
            || changes.get(cooperation::ANN_SAFE_TO_EVICT) == Some(&Some("false".into()));
        let a = Action::AnnotatePod {
            namespace: pod.namespace.clone(),
            pod: pod.name.clone(),
            changes,
        };
        if protects {
            out.actions.insert(0, a);
        } else {
            out.actions.push(a);
        }
    }
}
