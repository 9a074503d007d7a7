//! The virtual node names the members of one process register: each is one member's. A
//! member of `node` or `label=<key>` granularity names its virtual nodes after its lower
//! nodes or label values (`<nodename>-<group>`), so two members may come to the same name
//! (`vk-a` with zone `zone-1`, `vk-a-zone` with pool `1`). The first to claim a name keeps
//! it; the later member's clashing group is not registered (a Warning Event
//! `MemberNodeNameClash` on its Secret, and the log say so), and the rest of both members
//! run on. A group's name is also refused while an upper Node of that name is not the
//! member's ([`crate::node::owner`]: another member's, this process's or another
//! installation's, or a Node tensile did not register): so the order survives a restart
//! of the process, whichever member reaches its lower cluster first, and a lower cluster
//! never names its way onto another's Node. A Node that could not be read is read again
//! with backoff (the group waits meanwhile).
//!
//! A member's names are kept across its restarts and released when it is gone for good
//! (its Secret deleted and its leave done): a refused group is tried again then.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use backon::BackoffBuilder;

use k8s_openapi::api::core::v1::{Node, ObjectReference};
use kube::Client;
use kube::api::Api;
use kube::runtime::events::{EventType, Recorder};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::node::groups::{GroupNodes, GroupOffer};
use crate::node::owner::{Holding, NodeOwner};

/// The reason of the Event on a member Secret whose virtual node's name another member has.
pub const NODE_NAME_CLASH: &str = "MemberNodeNameClash";

/// How often refused names whose holder is an upper Node (not a member of this process)
/// are looked at again.
const RECHECK: Duration = Duration::from_secs(30);

/// A member, as it claims names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claimant {
    /// The member's `--nodename` (or `tensile.dev/node-name`): one per member.
    pub member: String,
    /// How a message names it: `member Secret <namespace>/<name>`, or `--nodename <node>`.
    pub described: String,
}

impl Claimant {
    /// The member `node`, of the Secret `secret` (`None`: the flags' member).
    pub fn new(node: &str, secret: Option<&ObjectReference>) -> Self {
        let described = match secret {
            Some(secret) => format!(
                "member Secret {}/{}",
                secret.namespace.as_deref().unwrap_or_default(),
                secret.name.as_deref().unwrap_or_default()
            ),
            None => format!("--nodename {node}"),
        };
        Self {
            member: node.to_owned(),
            described,
        }
    }
}

/// What claiming a name gave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The name is the claimant's now.
    Claimed,
    /// The name was the claimant's already (an earlier run of the member claimed it).
    Ours,
    /// Another member has it.
    HeldBy(Claimant),
}

/// The names claimed, by name (pure).
#[derive(Debug, Default)]
pub struct Claims(BTreeMap<String, Claimant>);

impl Claims {
    /// Claims `name` for `claimant`, unless another member has it.
    pub fn claim(&mut self, name: &str, claimant: &Claimant) -> Claim {
        match self.0.get(name) {
            Some(holder) if holder.member != claimant.member => Claim::HeldBy(holder.clone()),
            Some(_) => Claim::Ours,
            None => {
                self.0.insert(name.to_owned(), claimant.clone());
                Claim::Claimed
            }
        }
    }

    /// Gives `name` up, if `member` has it.
    pub fn unclaim(&mut self, name: &str, member: &str) {
        if self.0.get(name).is_some_and(|h| h.member == member) {
            self.0.remove(name);
        }
    }

    /// Gives up every name of `member`; whether it had any.
    pub fn release(&mut self, member: &str) -> bool {
        let before = self.0.len();
        self.0.retain(|_, holder| holder.member != member);
        self.0.len() != before
    }
}

/// The names the members of this process claimed ([`Claims`], shared), and a signal
/// each time a member gives its names up.
#[derive(Debug)]
pub struct NodeNames {
    claims: Mutex<Claims>,
    released: watch::Sender<u64>,
}

impl Default for NodeNames {
    fn default() -> Self {
        Self {
            claims: Mutex::default(),
            released: watch::Sender::new(0),
        }
    }
}

impl NodeNames {
    /// Claims `name` for `claimant` ([`Claims::claim`]).
    pub fn claim(&self, name: &str, claimant: &Claimant) -> Claim {
        self.lock().claim(name, claimant)
    }

    /// Gives up every name of the member `member` (gone for good): a member refused one
    /// of them tries again.
    pub fn release(&self, member: &str) {
        if self.lock().release(member) {
            self.released.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Claims> {
        self.claims.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The message of a clash: `claimant`'s virtual node `name` (group `group`) is not
/// registered, since `holder` has the name.
/// `group` is empty for a member of `cluster` granularity.
pub fn clash_message(name: &str, group: &str, claimant: &Claimant, holder: &str) -> String {
    if group.is_empty() {
        return format!(
            "node {name} of {} is not registered: {holder} has that name as a virtual node; \
             rename one member (tensile.dev/node-name) to end it",
            claimant.described
        );
    }
    format!(
        "virtual node {name} (group {group:?}) of {} is not registered: {holder} has that \
         name (the other groups run); rename one member (tensile.dev/node-name) to end it",
        claimant.described
    )
}

/// A member's groups as admitted: those whose virtual node's name is the member's.
pub struct Admission {
    names: Arc<NodeNames>,
    claimant: Claimant,
    /// Whose a Node of a group's name must be ([`NodeOwner::holding`]).
    owner: NodeOwner,
    /// The upper client that reads a name's Node.
    upper: Client,
    /// Where clashes are said (the member's Secret; the flags' member says them on the
    /// Node it does not take), and by whom.
    recorder: Recorder,
    secret: Option<ObjectReference>,
    /// The member's virtual nodes: a name admitted is released once its group is gone
    /// and its Node drained (no longer among them).
    nodes: Option<Arc<GroupNodes>>,
    /// Names admitted, each with its group's key: the member's while among its virtual
    /// nodes. Another group of the member whose name comes out the same is refused.
    ours: BTreeMap<String, String>,
    /// Names refused, each with its holder: not claimed again until one is released (or,
    /// held by a Node, every [`RECHECK`]).
    refused: BTreeMap<String, String>,
    /// Names whose Node could not be read, each with when it is read again (with
    /// backoff: a change of the offers meanwhile does not read it sooner).
    unread: BTreeMap<String, Instant>,
    unread_delays: Option<backon::ExponentialBackoff>,
    /// Groups refused because another group of the member has their name (said once).
    collided: BTreeSet<String>,
}

impl Admission {
    /// The admission of `claimant`'s groups (each Node of their names `owner`'s),
    /// its clashes said by `recorder` on its `secret` (or the Node); `nodes`, the member's
    /// virtual nodes (node granularity).
    pub fn new(
        names: Arc<NodeNames>,
        claimant: Claimant,
        owner: NodeOwner,
        upper: Client,
        (recorder, secret): (Recorder, Option<ObjectReference>),
        nodes: Option<Arc<GroupNodes>>,
    ) -> Self {
        Self {
            names,
            claimant,
            owner,
            upper,
            recorder,
            secret,
            nodes,
            ours: BTreeMap::new(),
            refused: BTreeMap::new(),
            unread: BTreeMap::new(),
            unread_delays: None,
            collided: BTreeSet::new(),
        }
    }

    /// The `offers` whose names are the member's: claimed (and, federated, no other
    /// member's Node). A clash newly found is logged and said on the Secret.
    pub async fn admit(
        &mut self,
        offers: BTreeMap<String, GroupOffer>,
    ) -> BTreeMap<String, GroupOffer> {
        self.release_gone();
        let offered: BTreeSet<String> = offers.values().map(|o| o.group.name.clone()).collect();
        self.unread.retain(|name, _| offered.contains(name));
        let now = Instant::now();
        let mut admitted = BTreeMap::new();
        for (key, offer) in offers {
            let name = offer.group.name.clone();
            match self.ours.get(&name) {
                Some(of) if *of == key => {
                    admitted.insert(key, offer);
                    continue;
                }
                Some(of) => {
                    if self.collided.insert(key.clone()) {
                        warn!(node = %name, group = %key, other = %of, cluster = "upper",
                            "two groups of the member come to one virtual node name: the later is not registered");
                    }
                    continue;
                }
                None => {}
            }
            if self.refused.contains_key(&name)
                || self.unread.get(&name).is_some_and(|at| *at > now)
            {
                continue;
            }
            let holder = match self.names.claim(&name, &self.claimant) {
                Claim::HeldBy(holder) => Some((holder.described, None)),
                // An earlier run of the member registered it.
                Claim::Ours => None,
                Claim::Claimed => {
                    let holder = self.node_holder(&name).await;
                    if !matches!(holder, Ok(None)) {
                        self.names.lock().unclaim(&name, &self.claimant.member);
                    }
                    match holder {
                        Ok(holder) => holder,
                        // Read again with backoff.
                        Err(()) => {
                            let delay = self.read_delay();
                            self.unread.insert(name, Instant::now() + delay);
                            continue;
                        }
                    }
                }
            };
            self.unread.remove(&name);
            match holder {
                None => {
                    self.collided.remove(&key);
                    self.ours.insert(name, key.clone());
                    admitted.insert(key, offer);
                }
                Some((holder, node)) => self.refuse(&name, &key, holder, node.as_ref()).await,
            }
        }
        if self.unread.is_empty() {
            self.unread_delays = None;
        }
        admitted
    }

    /// Releases the names admitted that are not among the member's virtual nodes (any
    /// more): a group drained and deleted, or a Node its fleet found another's. One still
    /// offered is claimed and its Node read again, as a new one: a Node of that name
    /// registered meanwhile by another is refused.
    fn release_gone(&mut self) {
        let Some(nodes) = &self.nodes else {
            return;
        };
        let gone: Vec<String> = self
            .ours
            .keys()
            .filter(|name| !nodes.contains(name))
            .cloned()
            .collect();
        for name in gone {
            self.names.lock().unclaim(&name, &self.claimant.member);
            self.ours.remove(&name);
        }
    }

    /// Who has the Node `name` ([`NodeOwner::holding`]), if not the member, with that Node;
    /// `Err` if it could not be read.
    async fn node_holder(&self, name: &str) -> Result<Option<(String, Option<Node>)>, ()> {
        match Api::<Node>::all(self.upper.clone()).get_opt(name).await {
            Ok(None) => Ok(None),
            Ok(Some(node)) => match self.owner.holding(&node) {
                Holding::Another(holder) => Ok(Some((holder, Some(node)))),
                Holding::Ours | Holding::Unrecorded => Ok(None),
            },
            Err(error) => {
                warn!(node = name, %error, cluster = "upper",
                    "reading the Node of a group's name before registering it; trying again");
                Err(())
            }
        }
    }

    /// Refuses `name` (group `key`): said once while it stays refused, on the member
    /// Secret, or (the flags' member) on the Node `node` it does not take.
    async fn refuse(&mut self, name: &str, key: &str, holder: String, node: Option<&Node>) {
        let message = clash_message(name, key, &self.claimant, &holder);
        warn!(
            node = name,
            group = key,
            reason = NODE_NAME_CLASH,
            cluster = "upper",
            "{message}"
        );
        let on = self
            .secret
            .clone()
            .or_else(|| node.map(|n| kube::Resource::object_ref(n, &())));
        if let Some(on) = on {
            super::leave::say(
                &self.recorder,
                &on,
                EventType::Warning,
                NODE_NAME_CLASH,
                message,
            )
            .await;
        }
        self.refused.insert(name.to_owned(), holder);
    }

    /// When the names whose Node could not be read are read again.
    fn next_read(&self) -> Option<Duration> {
        let at = self.unread.values().min()?;
        Some(at.saturating_duration_since(Instant::now()))
    }

    /// How long until a Node that could not be read is read again: 0.5 s doubling to
    /// [`RECHECK`], jittered, from the first failure until every name reads.
    fn read_delay(&mut self) -> Duration {
        let delays = self.unread_delays.get_or_insert_with(|| {
            backon::ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(500))
                .with_max_delay(RECHECK)
                .with_jitter()
                .without_max_times()
                .build()
        });
        delays.next().unwrap_or(RECHECK)
    }

    /// Keeps `admitted` to what of `offers` is the member's until `shutdown`: at each
    /// change, when another member gives names up, and every `RECHECK`.
    pub async fn follow(
        mut self,
        mut offers: watch::Receiver<BTreeMap<String, GroupOffer>>,
        admitted: watch::Sender<BTreeMap<String, GroupOffer>>,
        shutdown: CancellationToken,
    ) {
        let mut released = self.names.released.subscribe();
        let mut recheck = tokio::time::interval(RECHECK);
        recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        recheck.reset();
        loop {
            let read_again = self.next_read();
            tokio::select! {
                () = shutdown.cancelled() => return,
                changed = offers.changed() => if changed.is_err() { return },
                _ = released.changed() => self.forget_refusals(),
                _ = recheck.tick(), if !self.refused.is_empty() => self.forget_refusals(),
                () = tokio::time::sleep(read_again.unwrap_or_default()), if read_again.is_some() => {}
            }
            let now = offers.borrow_and_update().clone();
            let now = self.admit(now).await;
            admitted.send_replace(now);
        }
    }

    /// Refused names are claimed again at the next look.
    fn forget_refusals(&mut self) {
        if !self.refused.is_empty() {
            info!(refused = ?self.refused.keys().collect::<Vec<_>>(),
                "looking again at virtual node names another member had");
            self.refused.clear();
        }
    }

    /// Claims the one node `name` of a member of `cluster` granularity; `Err` says who has
    /// it (said on the Secret and logged). Whose the Node is, is checked as it is
    /// registered ([`crate::node::register`]).
    pub async fn claim_node(&mut self, name: &str) -> Result<(), String> {
        match self.names.claim(name, &self.claimant) {
            Claim::Ours | Claim::Claimed => Ok(()),
            Claim::HeldBy(holder) => {
                self.refuse(name, "", holder.described.clone(), None).await;
                Err(clash_message(name, "", &self.claimant, &holder.described))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claimant(member: &str) -> Claimant {
        Claimant {
            member: member.into(),
            described: format!("member Secret ns/{member}"),
        }
    }

    /// The first member to claim a name keeps it; claiming again is the claimant's own; a
    /// name given up (one, or all of a member gone) is the next claimant's.
    #[test]
    fn the_first_member_to_claim_a_name_keeps_it() {
        enum Step {
            Claim(&'static str, &'static str),
            Unclaim(&'static str, &'static str),
            Release(&'static str),
        }
        use Step::{Claim as C, Release as R, Unclaim as U};
        let held = |m: &str| Claim::HeldBy(claimant(m));
        let cases: Vec<(Step, Option<Claim>)> = vec![
            (C("a", "vk-a-zone-1"), Some(Claim::Claimed)),
            (C("a", "vk-a-zone-2"), Some(Claim::Claimed)),
            (C("c", "vk-a-zone-1"), Some(held("a"))),
            (C("c", "vk-a-zone-x"), Some(Claim::Claimed)),
            (C("a", "vk-a-zone-1"), Some(Claim::Ours)),
            // Another's name is not given up by the wrong member.
            (U("vk-a-zone-1", "c"), None),
            (C("c", "vk-a-zone-1"), Some(held("a"))),
            (U("vk-a-zone-2", "a"), None),
            (C("c", "vk-a-zone-2"), Some(Claim::Claimed)),
            (C("a", "vk-a-zone-2"), Some(held("c"))),
            (R("a"), None),
            (C("c", "vk-a-zone-1"), Some(Claim::Claimed)),
            (C("b", "vk-a-zone-x"), Some(held("c"))),
        ];
        let mut claims = Claims::default();
        for (i, (step, want)) in cases.into_iter().enumerate() {
            let got = match step {
                C(member, name) => Some(claims.claim(name, &claimant(member))),
                U(name, member) => {
                    claims.unclaim(name, member);
                    None
                }
                R(member) => {
                    assert!(claims.release(member), "step {i}: a had names");
                    None
                }
            };
            assert_eq!(got, want, "step {i}");
        }
        assert!(!claims.release("a"), "nothing left to release");
    }

    /// The Event's message names the node, both members and the way out.
    #[test]
    fn a_clash_names_both_members_and_the_node() {
        let secret = ObjectReference {
            namespace: Some("members".into()),
            name: Some("lower-c".into()),
            ..ObjectReference::default()
        };
        let c = Claimant::new("vk-a-zone", Some(&secret));
        assert_eq!(
            clash_message("vk-a-zone-1", "1", &c, "member Secret members/lower-a"),
            "virtual node vk-a-zone-1 (group \"1\") of member Secret members/lower-c is not \
             registered: member Secret members/lower-a has that name (the other groups run); \
             rename one member (tensile.dev/node-name) to end it"
        );
        assert_eq!(Claimant::new("vk", None).described, "--nodename vk");
    }
}
